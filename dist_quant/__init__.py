"""dist-quant: distributed-first FP8 training for PyTorch.

Public names are listed in API.md; each is importable from here.
"""

"""FP8 kernels: Triton implementations and the PyTorch reference they match bit for bit."""

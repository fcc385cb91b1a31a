"""Launchers, the `dist-quant` command line and the demo training job."""

"""FP8 modules that emit quantizer roles."""

"""Quantised checkpoints, one home: FP8 schemes (scheme.py), loading (loader.py, experts.py), the FP8 linear layer
the models use (linear.py) and the hand-offs between fused kernels (fusion.py). Kernels: batchgen/kernels/fp8/."""

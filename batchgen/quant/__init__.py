"""Quantised checkpoints, one home: the linear-layer interface the models use (linear.py), the FP8 modules
checkpoints load into (modules.py), FP8 schemes (scheme.py), loading (loader.py, experts.py) and the hand-offs
between fused kernels (fusion.py). Kernels: batchgen/kernels/fp8/."""

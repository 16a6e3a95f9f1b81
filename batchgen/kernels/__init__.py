"""Triton kernels, one folder a concern: attention/, fp8/, moe/, norm/, sample/, invariant/. Each kernel has a torch
reference (beside it or in its user) and an interpreter test; kernels import nothing above kernels/."""

"""Mixture-of-Experts kernels: routing (top-k, sorting tokens by expert) and the grouped expert GEMMs."""

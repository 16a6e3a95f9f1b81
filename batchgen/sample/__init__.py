"""Sampling on the device: per-row sampling tensors, deterministic noise, the sampler."""

"""Attention kernels over the paged KV cache, each with a torch reference that runs on any device."""

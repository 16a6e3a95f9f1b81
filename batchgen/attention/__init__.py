"""Attention: the paged KV cache, the kernel choice (backend), and the hook into transformers models (interface)."""

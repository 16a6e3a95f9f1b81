"""Paged attention kernels: decode (split-K, every query head of a KV head together), prefill over the paged
cache, rotary + K/V write; their launch tables (decode_launches.json) and the torch reference."""

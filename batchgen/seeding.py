"""Seed derivation: one 63-bit seed per (job seed, row key, sample index), stable across runs and machines."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any printable parts; same parts -> same seed in every process (no PYTHONHASHSEED)."""
    text = "\x1f".join(f"{type(p).__name__}:{p}" for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1

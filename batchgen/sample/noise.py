"""Sampling noise: a pure function of (seed, token position, vocab id), computed by an integer hash.

No generator state is shared between rows, so a sequence samples the same tokens whatever else is in the
batch, in whatever order requests arrive, after a preemption, and in a resumed or re-sharded job.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
# float32's largest value below 1. The top draw (2^24 - 0.5) / 2^24 is a tie between it and 1.0 in float32 and
# rounds to 1.0 (to even), whose Gumbel noise -log(-log(1)) is +inf: it would win over any logit, and on a
# masked (-inf) token give NaN, which argmax picks. Every draw is clamped to U_MAX (here and in the kernel).
U_MAX = 1.0 - 2.0 ** -24


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in [0, 2^32).
    Products may wrap around int64; only their low 32 bits are kept, which wrapping leaves exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=1 << 16)
def _seed_key(seed: int) -> int:
    """A sequence's part of its draws' keys (cached: a running sequence asks every step)."""
    return _mix32_int(seed & _MASK32) ^ _mix32_int((seed >> 32) + 0x9E3779B9)


def row_noise_key(seed: int, position: int) -> int:
    """The 32-bit key of the draw for the token at `position` of a sequence with `seed`."""
    return _mix32_int(_seed_key(seed) ^ _mix32_int(position + 0x85EBCA6B))


def _mix32_np(x: np.ndarray) -> np.ndarray:
    """_mix32_int over a uint64 array (products wrap modulo 2^64; their low 32 bits, all that is kept, are exact)."""
    x = x & _MASK32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(_MASK32)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & np.uint64(_MASK32)
    return x ^ (x >> np.uint64(16))


def row_noise_keys(seeds: list[int], positions: np.ndarray) -> np.ndarray:
    """row_noise_key of each (seeds[i], positions[i]), as int64 [S]: the per-step host cost of the sampler's keys
    at hundreds of rows is one cached lookup a row and a few array passes (was ~3 us of Python a row)."""
    keys = np.fromiter((_seed_key(s) for s in seeds), dtype=np.uint64, count=len(seeds))
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint64) + np.uint64(0x85EBCA6B)
    return _mix32_np(keys ^ _mix32_np(pos)).astype(np.int64)


def uniform_noise(noise_key: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] float32 in (0, 1), a pure function of (row key, vocab id)."""
    vocab_key = mix32(torch.arange(vocab_size, device=noise_key.device, dtype=torch.int64) + 0x27D4EB2F)
    bits = mix32(noise_key[:, None] ^ vocab_key[None, :])
    # 24 high-quality bits; the top one rounds to 1.0 in float32, hence the clamp (U_MAX says why)
    return (((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_(max=U_MAX)

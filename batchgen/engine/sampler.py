"""Sampler: one token per sampled sequence, from fp32 logits, on the logits' device.

Random draws use the Gumbel-max trick with noise that is a pure function of (seed, position, vocab id),
computed by an integer hash on the device. No generator state is shared between rows, so a sequence
samples the same tokens whatever else is in the batch, in whatever order requests arrive, after a
preemption, and in a resumed or re-sharded job.

Order of operations (as transformers' generate): repetition penalty, suppression (min_new_tokens),
temperature, top-k, top-p, min-p, then argmax (greedy) or Gumbel-max (sampling).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.batch import SeqSampling

_MASK32 = 0xFFFFFFFF


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


def row_noise_key(seed: int, position: int) -> int:
    """The 32-bit key of the draw for the token at `position` of a sequence with `seed`."""
    k = _mix32_int(seed & _MASK32) ^ _mix32_int((seed >> 32) + 0x9E3779B9)
    return _mix32_int(k ^ _mix32_int(position + 0x85EBCA6B))


@dataclass
class SamplingTensors:
    """Per-row sampling inputs on the logits' device. S = rows, P = longest penalty context."""

    temperature: torch.Tensor  # [S] float32, 0 for greedy rows
    top_k: torch.Tensor  # [S] int64, vocab size when off
    top_p: torch.Tensor  # [S] float32
    min_p: torch.Tensor  # [S] float32
    noise_key: torch.Tensor  # [S] int64 in [0, 2^32)
    penalty: torch.Tensor | None  # [S] float32, None when no row penalizes
    penalty_token_ids: torch.Tensor | None  # [S, P] int64 (padded by repeating a row's first token)
    suppress_rows: torch.Tensor | None  # [K] int64 with suppress_token_ids: logits[row, token] = -inf
    suppress_token_ids: torch.Tensor | None  # [K] int64
    any_random: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def build(cls, rows: list[SeqSampling], positions: list[int], vocab_size: int, device: torch.device,
              to_device: Callable[[list[np.ndarray]], list[torch.Tensor]] | None = None) -> SamplingTensors:
        """`positions[i]`: position of the token row i samples (noise depends on it). `to_device` moves a
        list of host arrays to the device in one go (the runner's pinned staging); default: one copy each."""
        arrays: dict[str, np.ndarray] = {
            "temperature": np.array([r.temperature for r in rows], dtype=np.float32),
            "top_k": np.array([r.top_k if 0 < r.top_k < vocab_size else vocab_size for r in rows], dtype=np.int64),
            "top_p": np.array([r.top_p for r in rows], dtype=np.float32),
            "min_p": np.array([r.min_p for r in rows], dtype=np.float32),
            "noise_key": np.array([row_noise_key(r.seed, p) for r, p in zip(rows, positions)], dtype=np.int64),
        }
        if any(r.repetition_penalty != 1.0 for r in rows):
            # histories are numpy views from the scheduler (one memory copy each), or any sequence of ids
            histories = [r.penalty_token_ids if r.penalty_token_ids is not None and len(r.penalty_token_ids) > 0
                         else (0,) for r in rows]
            width = max(len(h) for h in histories)
            padded = np.empty((len(rows), width), dtype=np.int64)
            for i, ids in enumerate(histories):
                padded[i, :len(ids)] = ids
                padded[i, len(ids):] = ids[0]
            arrays["penalty"] = np.array([r.repetition_penalty for r in rows], dtype=np.float32)
            arrays["penalty_token_ids"] = padded
        if any(r.suppressed_token_ids for r in rows):
            arrays["suppress_rows"] = np.array([i for i, r in enumerate(rows) for _ in r.suppressed_token_ids],
                                               dtype=np.int64)
            arrays["suppress_token_ids"] = np.array([t for r in rows for t in r.suppressed_token_ids], dtype=np.int64)
        if to_device is None:
            def to_device(host: list[np.ndarray]) -> list[torch.Tensor]:
                return [torch.from_numpy(a).to(device, non_blocking=True) for a in host]
        tensors = dict(zip(arrays, to_device(list(arrays.values()))))
        return cls(
            temperature=tensors["temperature"], top_k=tensors["top_k"], top_p=tensors["top_p"],
            min_p=tensors["min_p"], noise_key=tensors["noise_key"],
            penalty=tensors.get("penalty"), penalty_token_ids=tensors.get("penalty_token_ids"),
            suppress_rows=tensors.get("suppress_rows"), suppress_token_ids=tensors.get("suppress_token_ids"),
            any_random=any(r.temperature > 0 for r in rows),
            any_top_k=any(0 < r.top_k < vocab_size and r.temperature > 0 for r in rows),
            any_top_p=any(r.top_p < 1.0 and r.temperature > 0 for r in rows),
            any_min_p=any(r.min_p > 0.0 and r.temperature > 0 for r in rows),
        )


def uniform_noise(noise_key: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] float32 in (0, 1), a pure function of (row key, vocab id)."""
    vocab_key = mix32(torch.arange(vocab_size, device=noise_key.device, dtype=torch.int64) + 0x27D4EB2F)
    bits = mix32(noise_key[:, None] ^ vocab_key[None, :])
    # 24 high-quality bits -> exactly representable in float32, strictly inside (0, 1)
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits: [S, V] (any float dtype). Returns [S] int64 token ids."""
    logits = logits.float()
    vocab_size = logits.shape[-1]
    if st.penalty is not None:
        score = logits.gather(1, st.penalty_token_ids)
        p = st.penalty[:, None]
        logits = logits.scatter(1, st.penalty_token_ids, torch.where(score < 0, score * p, score / p))
    if st.suppress_rows is not None:
        # the fill value is made on the device: a host scalar tensor would be a synchronising copy
        logits = logits.index_put((st.suppress_rows, st.suppress_token_ids), logits.new_full((1,), float("-inf")))
    greedy = logits.argmax(dim=-1)
    if not st.any_random:
        return greedy
    x = logits / torch.where(st.temperature > 0, st.temperature, 1.0)[:, None]
    if st.any_top_k or st.any_top_p:
        sorted_x, sorted_idx = x.sort(dim=-1, descending=True)
        if st.any_top_k:
            kth = sorted_x.gather(1, (st.top_k - 1).clamp(0, vocab_size - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if st.any_top_p:
            probs = sorted_x.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop_sorted = mass_before >= st.top_p[:, None]
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(1, sorted_idx, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
    if st.any_min_p:
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(st.noise_key, vocab_size)))
    sampled = (x + gumbel).argmax(dim=-1)
    return torch.where(st.temperature > 0, sampled, greedy)

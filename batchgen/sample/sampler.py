"""Sampler: one token per sampled sequence, from fp32 logits, on the logits' device.

Random draws use the Gumbel-max trick with noise from `noise.py` (a function of seed, position and vocab id).
Order of operations (as transformers' generate): repetition penalty, suppression (min_new_tokens),
temperature, top-k, top-p, min-p, then argmax (greedy) or Gumbel-max (sampling).
"""

from __future__ import annotations

import torch

from batchgen.sample.noise import uniform_noise
from batchgen.sample.tensors import SamplingTensors

__all__ = ["SamplingTensors", "sample"]


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits: [S, V] (any float dtype). Returns [S] int64 token ids. Its kernels are the profiler's
    `batchgen.sample` range (bench/job profiles split a step's GPU time by it)."""
    with torch.profiler.record_function("batchgen.sample"):
        return _sample(logits, st)


def _sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
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

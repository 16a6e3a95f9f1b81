"""Sampler: one token per sampled sequence, from fp32 logits, on the logits' device.

Random draws use the Gumbel-max trick with noise from `noise.py` (a function of seed, position and vocab id).
Order of operations: a grammar's token bitmask (structured output), logit bias, repetition penalty (as
transformers' generate), frequency and presence penalties (as vLLM and OpenAI: output tokens only), suppression
(min_new_tokens), temperature, top-k, top-p, min-p, then argmax (greedy) or Gumbel-max (sampling).

Two implementations of the steps after suppression: `sample_ref` in torch (CPU, and the reference: a full sort
for top-k/top-p), and on CUDA the sort-free Triton kernel `kernels/sample/draw.py` (one program per row).
"""

from __future__ import annotations

import torch

from batchgen.kernels.sample.draw import sample_rows
from batchgen.sample.grammar_mask import apply_token_bitmask
from batchgen.sample.noise import uniform_noise
from batchgen.sample.tensors import SamplingTensors

__all__ = ["SamplingTensors", "sample", "sample_ref"]


def sample(logits: torch.Tensor, st: SamplingTensors, use_triton: bool = False) -> torch.Tensor:
    """logits: [S, V] (any float dtype). Returns [S] int64 token ids. Its kernels are the profiler's
    `batchgen.sample` range (bench/job profiles split a step's GPU time by it)."""
    with torch.profiler.record_function("batchgen.sample"):
        # structured output: grammar-masked tokens are -inf before penalties, temperature, filters
        if st.grammar_rows is not None:
            assert st.grammar_bitmask is not None, "a constrained row without its bitmask"
            rows = None if st.grammar_rows.shape[0] == logits.shape[0] else st.grammar_rows
            logits = apply_token_bitmask(logits, rows, st.grammar_bitmask)
        if not use_triton:
            return sample_ref(logits, st)
        if st.penalty is not None or st.suppress_rows is not None or st.bias_rows is not None:
            logits = apply_penalties(logits.float(), st)
        return sample_rows(logits, st.temperature, st.top_k, st.top_p, st.min_p, st.noise_key)


def apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Logit bias, the repetition / frequency / presence penalties and the suppressed tokens (min_new_tokens) on
    fp32 logits [S, V]. Each step runs only when some row of the step uses it (a row that does not carries
    neutral values), so a step with the repetition penalty alone rounds exactly as transformers' processor."""
    if st.bias_rows is not None:
        logits = logits.index_put((st.bias_rows, st.bias_token_ids), st.bias_values, accumulate=True)
    if st.penalty_counts is not None:
        counts = st.penalty_counts[st.penalty_slot]  # [S, V] int32: bit 0 prompt, >> 1 output count
        if st.any_repetition:  # tokens the row's sequence has seen: negative logits * p, positive / p
            p = st.penalty[:, None]
            logits = torch.where(counts != 0, torch.where(logits < 0, logits * p, logits / p), logits)
        if st.any_additive:  # output tokens: - frequency x count - presence once
            in_output = counts >> 1
            logits = logits - st.frequency[:, None] * in_output - st.presence[:, None] * (in_output > 0)
    if st.suppress_rows is not None:
        # the fill value is made on the device: a host scalar tensor would be a synchronising copy
        logits = logits.index_put((st.suppress_rows, st.suppress_token_ids), logits.new_full((1,), float("-inf")))
    return logits


def sample_ref(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The torch reference of every step (a full sort for top-k / top-p)."""
    logits = apply_penalties(logits.float(), st)
    vocab_size = logits.shape[-1]
    greedy = logits.argmax(dim=-1)
    if not st.any_random:
        return greedy
    x = logits / torch.where(st.temperature > 0, st.temperature, 1.0)[:, None]
    if st.any_top_k or st.any_top_p:
        sorted_x = x.sort(dim=-1, descending=True).values
        if st.any_top_k:
            kth = sorted_x.gather(1, (st.top_k - 1).clamp(0, vocab_size - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if st.any_top_p:
            # keep the shortest sorted prefix whose mass reaches top_p, and every token tied with its last one
            # (a tie is kept or dropped whole, whatever order the sort gave it: the kernel's rule too)
            probs = sorted_x.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            num_kept = (mass_before < st.top_p[:, None]).sum(dim=-1).clamp(min=1)  # a prefix: the mass grows
            boundary = sorted_x.gather(1, (num_kept - 1)[:, None])
            x = x.masked_fill(x < boundary, float("-inf"))
    if st.any_min_p:
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(st.noise_key, vocab_size)))
    sampled = (x + gumbel).argmax(dim=-1)
    return torch.where(st.temperature > 0, sampled, greedy)

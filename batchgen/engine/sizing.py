"""How many sequences (and tokens) a step holds when the job leaves `engine.max_num_seqs` /
`engine.max_num_batched_tokens` at `auto`. Pure functions of numbers the engine measured; no torch.

Two decisions, at two times:
1. at start-up, `capacity`: the most sequences the device's buffers are built for (decode graphs, sampler tables,
   the penalty table), from the memory left after the weights. On CUDA up to MAX_AUTO_SEQS (vLLM's offline default
   on H100/H200-class GPUs), its per-row buffers within ROW_SHARE of that memory; on CPU today's fixed default
   (a CPU step is compute-bound well below it, and a larger batch only adds memory and latency).
2. at the first step with queued prompts, `choose`: the batch within that capacity that the K/V cache holds to the
   end, from the queued sequences' lengths (prompt + max_new_tokens; without any, the model's context). A batch the
   cache cannot hold to the end is preempted and recomputed (engine/scheduler.py), so the choice stops there, but
   never below the fixed default the engine had before (MIN_AUTO_SEQS): where even that does not fit, preemption
   handles it as it did.
The number of batched tokens follows the sequences: TOKENS_PER_SEQ a sequence, between the former fixed default
and vLLM's offline default (256 sequences -> 8,192 tokens, 1,024 -> 16,384).
A number the user set always wins; then the other setting still follows these rules around it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_AUTO_SEQS = 1024
MIN_AUTO_SEQS = 256  # the fixed default before `auto`: an auto choice never runs fewer where the device allows it
CPU_AUTO_SEQS = 256
MIN_AUTO_BATCHED_TOKENS = 8192
MAX_AUTO_BATCHED_TOKENS = 16384
TOKENS_PER_SEQ = 16
ROW_SHARE = 0.1  # the most of the memory after the weights that per-sequence buffers may take


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a decode graph: 1, 2, 4, 8, multiples of 16 up to 512, multiples of 32 above, and
    `max_batch` itself. A step of n sequences replays the smallest bucket >= n (its rows past n are padding):
    at most 15 padded rows up to 512 and 31 above (< 6 % of the rows there), 52 graphs at 1,024."""
    sizes = {1, 2, 4, 8, *range(16, min(max_batch, 512) + 1, 16), *range(544, max_batch + 1, 32)}
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def bucket_at_most(num_seqs: int, max_batch: int) -> int:
    """The largest graph bucket of `max_batch` that is <= num_seqs (>= 1): a full batch replays its own graph."""
    return max([b for b in graph_buckets(max_batch) if b <= num_seqs] or [1])


def batched_tokens_for(num_seqs: int) -> int:
    return min(MAX_AUTO_BATCHED_TOKENS, max(MIN_AUTO_BATCHED_TOKENS, TOKENS_PER_SEQ * num_seqs))


@dataclass(frozen=True)
class RowCosts:
    """Device bytes besides the K/V cache that grow with the batch."""

    per_seq_bytes: int  # a sequence slot: the sampler's [S, V] buffers, the decode graphs' pool and static inputs
    per_batched_token_bytes: int  # activations of the largest step, a token

    def reserve_bytes(self, num_seqs: int, num_batched_tokens: int) -> int:
        return (num_seqs + 1) * self.per_seq_bytes + num_batched_tokens * self.per_batched_token_bytes


def seq_row_bytes(vocab_size: int, hidden_size: int, intermediate_size: int, qkv_width: int, act_bytes: int,
                  max_blocks_per_seq: int, graphs: bool) -> int:
    """Device bytes a sequence slot costs besides its K/V: the sampler's [S, V] buffers (the penalty table and up to
    three 4-byte temporaries of it), and with decode graphs the pool's share of the largest graph (its logits, counted
    as fp32, and one layer's activations: the pool holds the largest bucket's live tensors, never two graphs' at
    once) and the static inputs (a block-table row and five per-row scalars)."""
    sampler = 4 * 4 * vocab_size
    if not graphs:
        return sampler
    activations = (2 * intermediate_size + qkv_width + 3 * hidden_size) * act_bytes
    return sampler + 4 * vocab_size + activations + 4 * max_blocks_per_seq + 5 * 8


def row_costs(text_config, qkv_width: int, act_bytes: int, max_blocks_per_seq: int, graphs: bool) -> RowCosts:
    """RowCosts of a model from its (text) config: a transformers config or any object with vocab_size,
    hidden_size and, where it has an MLP of another width, intermediate_size. The per-token activations are the
    engine's long-standing estimate (16 fp32 hidden-sized tensors a batched token)."""
    hidden = text_config.hidden_size
    intermediate = getattr(text_config, "intermediate_size", None) or 4 * hidden
    return RowCosts(seq_row_bytes(text_config.vocab_size, hidden, intermediate, qkv_width, act_bytes,
                                  max_blocks_per_seq, graphs), hidden * 4 * 16)


@dataclass(frozen=True)
class Capacity:
    """What the engine builds its buffers for; `choose` picks the batch within it."""

    max_num_seqs: int
    max_num_batched_tokens: int
    auto_seqs: bool  # max_num_seqs is `auto`: `choose` may lower it
    auto_tokens: bool
    reason: str

    def describe(self) -> str:
        if not self.auto_seqs:
            return f"max_num_seqs {self.max_num_seqs}, max_num_batched_tokens {self.max_num_batched_tokens}" + \
                (" (auto)" if self.auto_tokens else "")
        return (f"max_num_seqs auto: up to {self.max_num_seqs} ({self.reason}), chosen at the first step from the "
                f"queued prompts' lengths")


def capacity(on_cuda: bool, max_num_seqs: int | None, max_num_batched_tokens: int | None, budget_bytes: int,
             costs: RowCosts) -> Capacity:
    """The batch the engine's buffers are built for. `max_num_seqs` / `max_num_batched_tokens`: the user's
    number, or None for auto. `budget_bytes`: device memory for the K/V cache and everything in `costs` (on CPU
    unused: the cap is CPU_AUTO_SEQS)."""
    if max_num_seqs is not None:
        seqs, reason = max_num_seqs, "set"
    elif not on_cuda:
        seqs, reason = CPU_AUTO_SEQS, "CPU"
    else:
        fit = int(ROW_SHARE * budget_bytes) // max(1, costs.per_seq_bytes) - 1
        seqs = bucket_at_most(min(MAX_AUTO_SEQS, max(1, fit)), MAX_AUTO_SEQS)
        reason = "auto's largest batch" if seqs == MAX_AUTO_SEQS else \
            f"graphs and sampler rows in {ROW_SHARE:.0%} of the memory after the weights"
    tokens = max_num_batched_tokens if max_num_batched_tokens is not None else batched_tokens_for(seqs)
    return Capacity(seqs, tokens, max_num_seqs is None, max_num_batched_tokens is None, reason)


@dataclass(frozen=True)
class BatchSize:
    max_num_seqs: int
    max_num_batched_tokens: int
    reason: str
    auto_seqs: bool = True
    auto_tokens: bool = True

    def describe(self) -> str:
        seqs = f"max_num_seqs auto -> {self.max_num_seqs} ({self.reason})" if self.auto_seqs else \
            f"max_num_seqs {self.max_num_seqs}"
        return f"{seqs}; max_num_batched_tokens {'auto -> ' if self.auto_tokens else ''}{self.max_num_batched_tokens}"


def choose(cap: Capacity, num_kv_tokens: int, seq_tokens: Sequence[int], context_len: int,
           graphs_to: int | None) -> BatchSize:
    """The batch for the run, within `cap`. `num_kv_tokens`: tokens the K/V cache holds; `seq_tokens`: the
    queued sequences' prompt + max_new_tokens each (a sample; empty: `context_len` each); `graphs_to`: the
    largest decode graph (None: no graphs)."""
    if not cap.auto_seqs:
        return BatchSize(cap.max_num_seqs, cap.max_num_batched_tokens, "set", False, cap.auto_tokens)
    per_seq = -(-sum(seq_tokens) // len(seq_tokens)) if seq_tokens else context_len
    per_seq = max(1, min(per_seq, context_len))
    fit = num_kv_tokens // per_seq
    floor = min(MIN_AUTO_SEQS, cap.max_num_seqs)
    seqs = min(cap.max_num_seqs, max(floor, fit))
    if not cap.auto_tokens:  # a decode step of every sequence must fit the user's token budget
        seqs = min(seqs, cap.max_num_batched_tokens)
    if graphs_to is not None and seqs < graphs_to:  # a full batch replays its own graph, unpadded
        seqs = bucket_at_most(seqs, graphs_to)
    tokens = batched_tokens_for(seqs) if cap.auto_tokens else cap.max_num_batched_tokens
    sample = f"{len(seq_tokens)} queued" if seq_tokens else "no queued prompts: the model's context"
    kv = f"KV for {fit} x {per_seq} tokens ({sample})"
    if seqs > fit:
        why = f"{kv}; not below {seqs}: what the cache cannot hold is preempted and recomputed"
    elif seqs == cap.max_num_seqs:
        why = f"{kv}; capped at {seqs}: {cap.reason}"
    else:
        why = kv
    if graphs_to is not None:
        why += f"; graphs to {graphs_to}"
    return BatchSize(seqs, tokens, why, True, cap.auto_tokens)

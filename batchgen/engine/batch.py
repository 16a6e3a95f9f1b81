"""The contract between scheduler and model runner: plain data describing one forward step. Pure Python.

A step is one packed (ragged, unpadded) forward pass: each scheduled sequence contributes the tokens whose
KV it computes this step (a prefill chunk, or one decode token); sequences that reach their end sample
one token from the logits of their last position. Nothing here refers to tensors or devices (block tables
may be read-only numpy views: host data).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from batchgen.sampling_params import SamplingParams


@dataclass(frozen=True)
class SeqSampling:
    """A sampling row of the step (only sequences with `sample=True` have one): the sequence's SamplingParams,
    from which sample/tensors.py derives the sampler's per-row inputs, and the sequence's own state at this
    step. A new sampling option is a field of SamplingParams: nothing here copies them."""

    params: SamplingParams
    seed: int  # this sample's seed (not params.seed): noise is a function of (seed, position, vocab id) only
    suppressed_token_ids: tuple[int, ...] = ()  # EOS / stop ids before min_new_tokens
    # params.uses_penalty_table: the sequence's row of the runner's PenaltyTable (sample/penalty.py), and, on
    # the first step that samples after the slot was assigned, its whole history (prompt + output, all known then:
    # a sequence is admitted only with no token in flight) to initialise that row, the first
    # `penalty_num_prompt` of them its prompt's; None on later steps, whose sampled tokens the runner counts
    # on the device.
    penalty_slot: int = -1
    penalty_history: Sequence[int] | np.ndarray | None = field(default=None, compare=False)
    penalty_num_prompt: int = 0
    # reasoning: >= 0: this token is the step's output whatever the sampler draws (thinking budget)
    forced_token_id: int = -1
    # structured output: the row's grammar state (sample/grammar.py GrammarState), or None. Its
    # bitmask for this step is filled by the engine only once the previous step's token is known (with the
    # async pipeline: after this step's forward is dispatched), then handed to the runner for the sampling.
    grammar: object | None = field(default=None, compare=False)
    # params.logprobs as an int read every step: K >= 0: the sampled token's log-prob and the top K; -1: none
    logprobs: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "logprobs", -1 if self.params.logprobs is None else self.params.logprobs)


class SeqSchedule(NamedTuple):
    """One sequence's part of a step. A NamedTuple (immutable, and built in a fraction of a frozen dataclass's
    time: the scheduler makes one per running sequence per step, hundreds a step)."""

    request_id: str
    input_token_ids: tuple[int, ...]  # tokens whose KV this step computes (a chunk of the sequence)
    start_pos: int  # position of input_token_ids[0] == tokens of this sequence already in the cache
    # covers start_pos + len(input_token_ids) tokens; the scheduler passes a read-only int32 numpy view
    # (`Request.block_table_view`: never changes once handed out), a tuple does as well
    block_table: Sequence[int]
    sampling: SeqSampling | None  # set iff this step reaches the end of the sequence: sample one token
    # Async pipeline: the last input token was sampled by the step still in flight and is not known here.
    # It is a placeholder (0); the runner replaces it on the device by that step's sampled token at this row.
    carry_from: int | None = None
    # logprobs / reasoning
    # Prompt log-probs: input_token_ids[prompt_logprob_offset + j] is scored against prompt_logprob_targets[j],
    # the prompt token after it (for a chunk's last position: the first token of the next chunk). Empty: none.
    prompt_logprob_offset: int = 0
    prompt_logprob_targets: tuple[int, ...] = ()

    @property
    def num_new_tokens(self) -> int:
        return len(self.input_token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the cache after this step."""
        return self.start_pos + len(self.input_token_ids)


@dataclass
class ScheduledBatch:
    seqs: list[SeqSchedule] = field(default_factory=list)
    num_prefill_tokens: int = 0  # tokens of sequences that do not sample this step or have > 1 new token
    num_decode_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    num_samples: int = 0  # sequences with `sampling` (one sampled token each), kept by the scheduler
    # logprobs / reasoning
    num_logprob_seqs: int = 0  # sequences asking for log-probs (prompt or sampled): 0 -> the runner skips them
    num_forced: int = 0  # sequences with a forced token (thinking budget)
    num_constrained: int = 0  # structured output: sampling rows with a grammar

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass(frozen=True)
class StepOutput:
    """What one step gives back to the host (the runner -> scheduler contract): the sampled ids, and the
    log-probs that rows asked for. Room for grammar state."""

    token_ids: list[int]  # one per sequence with `sampling`, in `ScheduledBatch.seqs` order
    # logprobs / reasoning
    # R = sampling rows with `logprobs >= 0`, in batch order; K = the largest `logprobs` among them (a row
    # keeps its own first K). None when no row of the step asked.
    logprobs: np.ndarray | None = None  # [R] float32: the sampled (or forced) token's log-prob
    top_token_ids: np.ndarray | None = None  # [R, K] int64, most likely first
    top_logprobs: np.ndarray | None = None  # [R, K] float32
    # every sequence's `prompt_logprob_targets` scored, concatenated in batch order; None when none
    prompt_logprobs: np.ndarray | None = None  # [P] float32

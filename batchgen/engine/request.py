"""Request: one sequence (one sample of one prompt) and its lifecycle. Pure Python.

Lifecycle: WAITING -> RUNNING -> FINISHED, with RUNNING -> WAITING on preemption (blocks freed, KV
recomputed later from prompt + generated tokens) and WAITING -> FAILED for a request that can never run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
import numpy as np

from batchgen.engine.detokenizer import StopStringWatcher
from batchgen.engine.list_mirror import ListMirror
from batchgen.engine.reasoning import ThinkingBudget
from batchgen.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_new_tokens or the model's context
    STOP_STRING = "stop_string"  # a stop string appeared in the decoded text
    ERROR = "error"  # never ran, or failed on its own (not the engine's fault); `Request.error` says why


class RequestFault(Exception):
    """A fault of one sequence (its grammar, its tokenizer output), not of the engine: the engine finishes that
    sequence with FinishReason.ERROR and `error_class`, and the other sequences go on."""

    def __init__(self, error_class: str, message: str) -> None:
        super().__init__(message)
        self.error_class = error_class


@dataclass(eq=False)
class Request:
    request_id: str  # unique per sample: "<prompt id>#<sample idx>"
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # this sample's seed (already derived from params.seed and sample_idx)
    eos_token_ids: frozenset[int]
    max_model_len: int
    sample_idx: int = 0
    prompt_id: str = ""  # the id add_request returned: results are gathered per prompt under it
    stop_watcher: StopStringWatcher | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + output; the KV of token_ids[:num_computed_tokens] is in the cache.
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    block_keys: list = field(default_factory=list)  # prefix-cache keys of the leading full blocks
    # Async pipeline: tokens sampled by dispatched steps whose ids the host does not know yet (0, 1 or 2),
    # and the sample row of the latest one in its step's output.
    num_pending: int = 0
    pending_row: int = -1
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_class: str | None = None  # with `error`: what kind of fault (a job's reject class)
    # Sibling samples (n > 1) wait until this request's prompt is in the cache, then reuse its blocks.
    followers: list[Request] = field(default_factory=list)
    last_sampling: object | None = None  # the scheduler's latest SeqSampling, reused while it is unchanged
    # repetition / presence / frequency penalty: this sequence's row of the runner's PenaltyTable while it runs
    # (-1: none), and whether its history has been sent to that row since the slot was assigned
    penalty_slot: int = -1
    penalty_history_sent: bool = False
    # logprobs / reasoning
    output_logprobs: list[float] = field(default_factory=list)  # one per output token (params.logprobs set)
    # K per output token, as row views of each step's [R, K] arrays (no Python tuple per value: at 256 rows and
    # K = 5 those cost ~0.8 ms a step on the loop's thread, and ~5 ms a row when pyarrow converted them)
    output_top_ids: list[np.ndarray] = field(default_factory=list)  # [K] int64 each
    output_top_values: list[np.ndarray] = field(default_factory=list)  # [K] float32 each
    # prompt log-probs (params.prompt_logprobs, sample 0 only): entry i scores prompt token i (entry 0 None);
    # positions < num_scored_prompt_positions are scheduled (their values land with their step's update,
    # also after a preemption), so the prefix cache may serve only that far (no logits for cached tokens)
    prompt_logprobs: list[float | None] | None = None
    num_scored_prompt_positions: int = 0
    thinking: ThinkingBudget | None = None  # params.thinking_budget set: the think block's state
    # structured output: params.response_format's matcher (sample/grammar.py GrammarState), own to
    # this sample. Invariant: it has accepted exactly output_token_ids (a preempted sequence keeps its tokens
    # and recomputes their KV only, so its matcher stays as it is)
    grammar: object | None = None
    # a numpy mirror of `block_table` (see `block_table_view`)
    _table_mirror: ListMirror = field(default_factory=lambda: ListMirror(np.int32), repr=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.scores_prompt and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """This sequence computes the prompt's log-probs: sample 0 of a prompt that asks (siblings share them)."""
        return self.params.prompt_logprobs and self.sample_idx == 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this sequence can ever hold in the cache."""
        return min(self.num_prompt_tokens + self.params.max_new_tokens, self.max_model_len)

    @property
    def is_finished(self) -> bool:
        status = self.status  # identity tests: an enum's `in` compares with __eq__, ~4x slower every step
        return status is RequestStatus.FINISHED or status is RequestStatus.FAILED

    def can_extend(self) -> bool:
        """Whether another token may be scheduled now. With a token in flight: not if that token alone may
        end the sequence by length. (A repetition penalty's table gets the in-flight id on the device.)"""
        if self.num_pending == 0:
            return True
        if self.thinking is not None and not self.thinking.may_schedule_with(self.num_pending):
            return False
        return (len(self.output_token_ids) + self.num_pending < self.params.max_new_tokens
                and self.num_tokens + self.num_pending < self.max_model_len)

    def block_table_view(self) -> np.ndarray:
        """`block_table` as a read-only int32 array, kept in step with the list at O(new blocks) a call
        (engine/list_mirror.py says why handing it out is safe)."""
        return self._table_mirror.view(self.block_table)

    def suppressed_token_ids(self) -> tuple[int, ...]:
        """Tokens that must not be sampled now (EOS and stop ids before min_new_tokens)."""
        if len(self.output_token_ids) + self.num_pending >= self.params.min_new_tokens:
            return ()
        eos = () if self.params.ignore_eos else tuple(self.eos_token_ids)
        return eos + self.params.stop_token_ids

    def append_token(self, token_id: int) -> FinishReason | None:
        """Record a sampled token; return why the request is now finished, or None."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if self.thinking is not None:
            self.thinking.append(token_id)
        # structured output: the mask allowed only tokens the grammar accepts here
        if self.grammar is not None:
            if self.grammar.dead_end:
                stops = list(self.params.stop_token_ids)
                raise RequestFault("grammar_error", f"the response_format allows no next token after "
                                   f"{len(self.output_token_ids) - 1} tokens" + (
                                       f": every token it allows here is one of stop_token_ids {stops}, which "
                                       f"end a completion only where the format may end" if stops else ""))
            if not self.grammar.accept(token_id):
                raise RequestFault("grammar_error", f"token {token_id} was sampled under a grammar that does "
                                   f"not accept it (after {len(self.output_token_ids) - 1} tokens)")
            if self.grammar.terminated:  # a stop token of the grammar, or the grammar complete without one
                return FinishReason.STOP
        num_out = len(self.output_token_ids)
        if num_out >= self.params.min_new_tokens:
            if token_id in self.params.stop_token_ids:
                return FinishReason.STOP
            if not self.params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
        if self.stop_watcher is not None and self.stop_watcher.hit(self.output_token_ids):
            return FinishReason.STOP_STRING
        if num_out >= self.params.max_new_tokens or self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

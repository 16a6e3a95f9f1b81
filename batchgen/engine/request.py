"""Request: one sequence (one sample of one prompt) and its lifecycle. Pure Python.

Lifecycle: WAITING -> RUNNING -> FINISHED, with RUNNING -> WAITING on preemption (blocks freed, KV
recomputed later from prompt + generated tokens) and WAITING -> FAILED for a request that can never run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

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
    ERROR = "error"  # never ran; `Request.error` says why


class StopStringWatcher(Protocol):
    """Incremental stop-string detection over the generated tokens (owned by the engine, needs a tokenizer)."""

    def hit(self, output_token_ids: list[int]) -> bool: ...


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # this sample's seed (already derived from params.seed and sample_idx)
    eos_token_ids: frozenset[int]
    max_model_len: int
    sample_idx: int = 0
    arrival_idx: int = 0  # admission order; lower is older
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
    # Sibling samples (n > 1) wait until this request's prompt is in the cache, then reuse its blocks.
    followers: list[Request] = field(default_factory=list)
    last_sampling: object | None = None  # the scheduler's latest SeqSampling, reused while it is unchanged
    # int32 mirror of `block_table` (see `block_table_view`): the list it mirrors, a buffer, entries mirrored
    _table_src: list[int] | None = field(default=None, repr=False)
    _table_buf: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32), repr=False)
    _table_len: int = field(default=0, repr=False)
    _table_view: np.ndarray | None = field(default=None, repr=False)
    # int64 mirror of `token_ids` for repetition-penalty histories (see `token_ids_view`)
    _ids_src: list[int] | None = field(default=None, repr=False)
    _ids_buf: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64), repr=False)
    _ids_len: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

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
        return self.status in (RequestStatus.FINISHED, RequestStatus.FAILED)

    def can_extend(self) -> bool:
        """Whether another token may be scheduled now. With a token in flight: not if that token alone may
        end the sequence by length. (A repetition penalty's history gets the in-flight id on the device.)"""
        if self.num_pending == 0:
            return True
        return (len(self.output_token_ids) + self.num_pending < self.params.max_new_tokens
                and self.num_tokens + self.num_pending < self.max_model_len)

    def block_table_view(self) -> np.ndarray:
        """`block_table` as a read-only int32 array, kept in step with the list at O(new blocks) a call, not
        O(blocks): a step's arrays are then filled without a Python loop over every block of every sequence.

        Invariant that makes handing out views safe: a block table only grows by appends in place, or is
        replaced by a new list (admission, preemption, finish). An earlier view keeps its contents: appends
        write past its end, a full buffer is replaced (the view keeps the old one), a new list gets a new buffer."""
        src = self.block_table
        if self._table_src is src and len(src) == self._table_len:
            return self._table_view  # unchanged since the last call: most decode steps
        if self._table_src is not src:
            self._table_src, self._table_buf, self._table_len = src, np.empty(max(16, len(src)), np.int32), 0
        n = len(src)
        if n > self._table_len:
            if n > len(self._table_buf):
                grown = np.empty(max(n, 2 * len(self._table_buf)), np.int32)
                grown[:self._table_len] = self._table_buf[:self._table_len]
                self._table_buf = grown
            self._table_buf[self._table_len:n] = src[self._table_len:n]
            self._table_len = n
        view = self._table_view = self._table_buf[:n]
        view.flags.writeable = False
        return view

    def token_ids_view(self, placeholder: bool) -> np.ndarray:
        """`token_ids` as a read-only int64 array (plus one trailing slot for the in-flight token when
        `placeholder`), kept in step with the list at O(new tokens) a call: a repetition penalty's history
        without converting the whole sequence from Python every step.

        Same invariant as `block_table_view`: `token_ids` only grows by appends (or is replaced by a new
        list), so an earlier view keeps its contents, except its placeholder slot, which is where the next
        append writes. That is harmless: the runner overwrites placeholders on the device with the sampled id."""
        src = self.token_ids
        if self._ids_src is not src:
            self._ids_src, self._ids_buf, self._ids_len = src, np.empty(max(64, len(src) + 1), np.int64), 0
        n = len(src)
        size = n + placeholder
        if size > len(self._ids_buf):
            grown = np.empty(max(size, 2 * len(self._ids_buf)), np.int64)
            grown[:self._ids_len] = self._ids_buf[:self._ids_len]
            self._ids_buf = grown
        if n > self._ids_len:
            self._ids_buf[self._ids_len:n] = src[self._ids_len:n]
            self._ids_len = n
        if placeholder:
            self._ids_buf[n] = 0
        view = self._ids_buf[:size]
        view.flags.writeable = False
        return view

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

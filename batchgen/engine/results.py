"""What the engine gives back: one PromptResult per prompt, one Sample per sample of it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from batchgen.engine.request import Request


@dataclass(eq=False)
class Sample:
    """One sample of a prompt. Equality compares every field, the top-K arrays by value."""

    sample_idx: int
    token_ids: list[int]
    text: str | None  # None when the engine has no tokenizer
    finish_reason: str  # "stop" | "length" | "stop_string" | "error"
    seed: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    error: str | None = None  # finish_reason "error": why (this sample alone failed; the others are whole)
    error_class: str | None = None  # with `error`: too_long_for_cache, empty_prompt, grammar_error, ...
    # logprobs / reasoning (SamplingParams.logprobs set; raw-logit log_softmax, fp32)
    logprobs: list[float] | None = None  # one per token_ids entry: that token's log-prob
    # SamplingParams.logprobs K > 0: per token, the K most likely tokens, best first (None when K is 0 or unset)
    top_logprob_ids: np.ndarray | None = None  # [T, K] int32
    top_logprob_values: np.ndarray | None = None  # [T, K] float32

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        """Per token: K (token id, log-prob) pairs, best first; None when K is 0 or unset."""
        if self.top_logprob_ids is None:
            return None
        return [list(zip(i, v)) for i, v in zip(self.top_logprob_ids.tolist(), self.top_logprob_values.tolist())]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        return all(_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


@dataclass
class PromptResult:
    request_id: str
    prompt_token_ids: list[int]
    samples: list[Sample] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one per prompt token, entry 0 None (nothing scores the first token)
    prompt_logprobs: list[float | None] | None = None


def top_logprob_arrays(req: Request, k: int | None) -> dict[str, np.ndarray]:
    """Sample's top-K fields from the request's per-token row views (empty: K unset or 0)."""
    if not k:
        return {}
    n = len(req.output_top_ids)
    ids = np.stack(req.output_top_ids).astype(np.int32) if n else np.zeros((0, k), np.int32)
    values = np.stack(req.output_top_values).astype(np.float32) if n else np.zeros((0, k), np.float32)
    return {"top_logprob_ids": ids, "top_logprob_values": values}

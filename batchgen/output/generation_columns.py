"""The issue-14 output columns: log-probs (sampling.logprobs, sampling.prompt_logprobs) and the reasoning split
(output.reasoning). Each exists only when the job asks for it, so a job without them keeps the plain schema.

Log-prob columns align with the generated tokens (completion_token_ids), the think block's included; the
reasoning split cuts the text at the think markers' token positions (engine/reasoning.py), keeping whitespace
as generated.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from batchgen.engine.detokenizer import final_text, text_token_ids
from batchgen.engine.reasoning import ReasoningMarkers
from batchgen.output.arrow_columns import GridCell
from batchgen.errors import JobError
from batchgen.config import JobSpec

TOP_LOGPROB = pa.struct([pa.field("token_id", pa.int32()), pa.field("logprob", pa.float32())])


def resolve_markers(spec: JobSpec, tokenizer) -> ReasoningMarkers | None:
    """output.reasoning's markers: explicit ones, the tokenizer's own (auto), or None."""
    setting = spec.output.reasoning
    if setting == "none":
        return None
    if setting == "auto":
        return ReasoningMarkers.auto(tokenizer)
    try:
        return ReasoningMarkers.from_strings(tokenizer, setting.start, setting.end)
    except ValueError as e:
        raise JobError(f"output.reasoning: {e}") from None


def budget_markers(spec: JobSpec, tokenizer, markers: ReasoningMarkers | None) -> ReasoningMarkers | None:
    """The markers sampling.thinking_budget runs on (output.reasoning's, else the tokenizer's); a job that sets
    the budget without a usable one-token end marker is refused up front."""
    markers = markers or ReasoningMarkers.auto(tokenizer)
    if spec.sampling.thinking_budget is None:
        return markers
    if markers is None:
        raise JobError("sampling.thinking_budget needs think markers: the tokenizer has no <think> / </think> "
                       "tokens; name them in output.reasoning: {start: ..., end: ...}")
    if len(markers.end_ids) != 1:
        raise JobError(f"sampling.thinking_budget needs an end marker of one token, but output.reasoning's end "
                       f"encodes to {len(markers.end_ids)} tokens {list(markers.end_ids)}; name a marker that "
                       f"is one token of the vocabulary, or drop thinking_budget")
    return markers


def reasoning_fields(with_reasoning: bool) -> list[pa.Field]:
    return [pa.field("reasoning", pa.string())] if with_reasoning else []


def count_fields(with_reasoning: bool) -> list[pa.Field]:
    return [pa.field("num_reasoning_tokens", pa.int32())] if with_reasoning else []


def logprob_fields(spec: JobSpec) -> list[pa.Field]:
    fields = []
    k = spec.sampling.logprobs
    if k is not None:
        fields.append(pa.field("completion_logprobs", pa.list_(pa.float32())))
        if k > 0:
            fields.append(pa.field("completion_top_logprobs", pa.list_(pa.list_(TOP_LOGPROB))))
    if spec.sampling.prompt_logprobs:
        fields.append(pa.field("prompt_logprobs", pa.list_(pa.float32())))
    return fields


def split_text(tokenizer, markers: ReasoningMarkers, prompt_ids: list[int], sample, stop: tuple[str, ...],
               stop_token_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """completion (the answer only), reasoning (None without a think block) and num_reasoning_tokens."""
    ids = text_token_ids(sample.token_ids, sample.finish_reason, stop_token_ids)
    cut = sample.finish_reason == "stop_string"
    span = markers.split(prompt_ids, ids)
    if span is None:
        return {"completion": sample.text, "reasoning": None, "num_reasoning_tokens": 0}
    first, end, answer = span
    return {"completion": final_text(tokenizer, ids[answer:], stop, cut_at_stop=cut),
            "reasoning": final_text(tokenizer, ids[first:end], stop, cut_at_stop=cut and answer >= len(ids)),
            "num_reasoning_tokens": end - first}


def logprob_values(spec: JobSpec, result, sample) -> dict[str, Any]:
    out: dict[str, Any] = {}
    k = spec.sampling.logprobs
    if k is not None:
        out["completion_logprobs"] = np.asarray(sample.logprobs, dtype=np.float32)
        if k > 0:  # arrays until the shard is written (output/arrow_columns.py)
            out["completion_top_logprobs"] = GridCell((sample.top_logprob_ids, sample.top_logprob_values))
    if spec.sampling.prompt_logprobs:
        out["prompt_logprobs"] = result.prompt_logprobs
    return out

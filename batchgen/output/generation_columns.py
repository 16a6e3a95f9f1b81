"""The output columns of log-probs (sampling.logprobs, sampling.prompt_logprobs, output.logprob_tokens) and of
the reasoning split (output.reasoning). Each exists only when the job asks for it, so a job without them keeps
the plain schema.

Log-prob columns align with the generated tokens (completion_token_ids), the think block's included; with
output.logprob_tokens each token's text (the token decoded alone) is stored beside its id. The reasoning split
cuts the text at the think markers' token positions (engine/reasoning.py), keeping whitespace as generated.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

import numpy as np
import pyarrow as pa

from batchgen.engine.detokenizer import final_text, text_token_ids
from batchgen.engine.reasoning import ReasoningMarkers
from batchgen.output.arrow_columns import GridCell
from batchgen.errors import JobError
from batchgen.config import JobSpec

TOP_LOGPROB = pa.struct([pa.field("token_id", pa.int32()), pa.field("logprob", pa.float32())])
TOP_LOGPROB_WITH_TOKEN = pa.struct([pa.field("token_id", pa.int32()), pa.field("token", pa.string()),
                                    pa.field("logprob", pa.float32())])  # output.logprob_tokens

# {tokenizer: {token id: its text}}: each id decoded once per tokenizer (top-K log-probs repeat a few thousand ids)
_TOKEN_TEXTS: WeakKeyDictionary = WeakKeyDictionary()


def token_texts(tokenizer, ids) -> np.ndarray:
    """The text of each token id decoded alone (special tokens as written; a token holding part of a character
    decodes to U+FFFD), as an object array of the ids' shape."""
    ids = np.asarray(ids, dtype=np.int64)
    memo = _TOKEN_TEXTS.setdefault(tokenizer, {})
    flat = ids.reshape(-1).tolist()
    missing = sorted(set(flat) - memo.keys())
    if missing:
        memo.update(zip(missing, tokenizer.batch_decode([[i] for i in missing])))
    out = np.empty(len(flat), dtype=object)
    out[:] = [memo[i] for i in flat]
    return out.reshape(ids.shape)


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
        if spec.output.logprob_tokens:
            fields.append(pa.field("completion_logprob_tokens", pa.list_(pa.string())))
        if k > 0:
            top = TOP_LOGPROB_WITH_TOKEN if spec.output.logprob_tokens else TOP_LOGPROB
            fields.append(pa.field("completion_top_logprobs", pa.list_(pa.list_(top))))
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


def logprob_values(spec: JobSpec, result, sample, tokenizer=None) -> dict[str, Any]:
    """The log-prob columns of one sample; `tokenizer`: needed with output.logprob_tokens."""
    out: dict[str, Any] = {}
    k = spec.sampling.logprobs
    with_text = k is not None and spec.output.logprob_tokens
    if with_text and tokenizer is None:
        raise ValueError("output.logprob_tokens: the tokenizer is needed to write the tokens' text")
    if k is not None:
        out["completion_logprobs"] = np.asarray(sample.logprobs, dtype=np.float32)
        if with_text:
            out["completion_logprob_tokens"] = token_texts(tokenizer, sample.token_ids)
        if k > 0:  # arrays until the shard is written (output/arrow_columns.py)
            ids = sample.top_logprob_ids
            out["completion_top_logprobs"] = GridCell(
                (ids, token_texts(tokenizer, ids), sample.top_logprob_values) if with_text
                else (ids, sample.top_logprob_values))
    if spec.sampling.prompt_logprobs:
        out["prompt_logprobs"] = result.prompt_logprobs
    return out

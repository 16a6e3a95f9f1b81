"""A row's way through generation: its prompt, kept columns, sampling and seeds prepared from its source columns
(`prepare_row`), and the output rows of its samples (`completion_rows`). The job runner writes those as shards;
the Ray Data stage returns them as a batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.config import JobSpec
from batchgen.output import generation_columns as gen
from batchgen.seeding import derive_seed


@dataclass
class PreparedRow:
    text: str  # the rendered prompt
    token_ids: list[int]
    kept: dict[str, Any]  # the source columns the output keeps, typed as the output schema says
    params: Any  # SamplingParams: the job's, or the row's own
    seeds: list[int]  # one per sample


def prepare_row(columns: dict[str, Any], key: Any, renderer, schema, row_sampling, typed: bool) -> PreparedRow:
    """RowError (the row is rejected with its class) when its prompt, kept values or sampling do not hold up.
    `typed`: the source's values match its schema (False for JSONL: kept values are coerced)."""
    text = renderer.render(columns)
    ids = renderer.tokenize(text)
    kept = {c: columns.get(c) for c in schema.kept}
    if not typed:
        kept = schema.coerce(kept)
    params = row_sampling.params_for(columns)
    return PreparedRow(text, ids, kept, params, [derive_seed(params.seed, key, i) for i in range(params.n)])


def completion_rows(spec: JobSpec, key_name: str, tokenizer, reasoning, key: Any, kept: dict[str, Any],
                    prompt: str, num_prompt_tokens: int, params, result) -> list[dict[str, Any]]:
    """`reasoning`: the think markers when output.reasoning splits completions (else None); `params`: the row's
    SamplingParams; `result`: the engine's RequestResult."""
    rows = []
    for s in result.samples:
        r = {key_name: key, "sample_idx": s.sample_idx, **kept}
        if spec.output.keep_prompt:
            r["prompt"] = prompt
        r["completion"] = s.text
        if reasoning is not None:
            r.update(gen.split_text(tokenizer, reasoning, result.prompt_token_ids, s, params.stop,
                                    params.stop_token_ids))
        if spec.output.keep_token_ids:
            r["completion_token_ids"] = list(s.token_ids)
        r.update(finish_reason=s.finish_reason, num_prompt_tokens=num_prompt_tokens,
                 num_completion_tokens=len(s.token_ids), num_cached_tokens=s.num_cached_tokens, seed=s.seed)
        r.update(gen.logprob_values(spec, result, s, tokenizer))
        rows.append(r)
    return rows

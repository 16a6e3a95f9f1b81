"""Per-row sampling settings: `source.sampling_column` names a column holding, for its row, a JSON object (or
its text) of `sampling:` fields that override the job's. Each distinct value is validated once, exactly as the
job's `sampling:` section is (unknown field, wrong type, out of range); a bad one rejects its row as
`bad_sampling` with the field named, and the job goes on. An empty or null value, or a null field, means the
job's settings (Parquet struct columns give absent fields as null).
A row's own `seed` replaces the job's as the root of its samples' seeds.

structured output: `sampling.response_format_column` names a column holding a JSON Schema per row (JSON
text, or an object); it replaces the row's response_format (type json_schema). Null or empty: the job's (or the
row's sampling_column's) format. A value that is not JSON, not an object, or a schema xgrammar refuses rejects
its row as `bad_response_format`, with xgrammar's reason; each distinct value is checked once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from batchgen.errors import JobError, RowError
from batchgen.config import JobSpec
from batchgen.sampling_params import ResponseFormat, SamplingParams

MAX_CACHED = 4096  # distinct values kept parsed (most jobs have a handful)
# settings that decide which output columns exist: job-wide only, a row may not change them
JOB_WIDE = ("logprobs", "prompt_logprobs")


class RowSampling:
    def __init__(self, spec: JobSpec, columns: list[str], vocab_size: int | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        """`vocab_size`: the model's, to reject a row's logit_bias / stop_token_ids ids it lacks (None: unchecked
        here; the engine still refuses them when the row is added). `warn`: told, once a run, of the first row
        schema (response_format_column) using keywords xgrammar does not enforce; `num_unenforced` counts the
        distinct ones."""
        self.column = spec.source.sampling_column
        self.vocab_size = vocab_size
        self.job = spec.sampling
        self.max_samples_per_row = spec.limits.max_samples_per_row
        if self.column is not None and self.column not in columns:
            raise JobError(f"source.sampling_column {self.column!r} is not a column of the source; columns: "
                           f"{', '.join(columns)}")
        self._cache: dict[str, SamplingParams] = {}
        # structured output
        self.format_column = spec.sampling.response_format_column
        if self.format_column is not None and self.format_column not in columns:
            raise JobError(f"sampling.response_format_column {self.format_column!r} is not a column of the source; "
                           f"columns: {', '.join(columns)}")
        self._formats: dict[str, ResponseFormat] = {}
        self.warn = warn
        self.num_unenforced = 0

    def params_for(self, columns: dict[str, Any]) -> SamplingParams:
        """The row's sampling settings; RowError('bad_sampling' / 'bad_response_format') when a value is not
        valid."""
        params = self._sampling_for(columns)
        if self.format_column is None:
            return params
        value = columns.get(self.format_column)
        rf = None if value is None or value == "" else self._response_format(value)
        if rf is None:  # null, empty, or an empty object ({} or its text "{}"): the job's format
            return params
        try:
            return SamplingParams.model_validate({**params.model_dump(exclude={"response_format_column"}),
                                                  "response_format": rf})
        except ValidationError as e:  # the row's own sampling_column asked for min_new_tokens / thinking_budget
            raise RowError("bad_response_format", f"column {self.format_column!r}: "
                                                  f"{e.errors()[0]['msg'].removeprefix('Value error, ')}") from None

    def _response_format(self, value: Any) -> ResponseFormat | None:
        """The row's format, None for an empty object (the job's format applies); RowError when not usable."""
        from batchgen.sample.grammar import grammar_error
        from batchgen.sample.grammar_checks import unenforced_warning

        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        rf = self._formats.get(text)
        if rf is not None:
            return rf
        where = f"sampling.response_format_column {self.format_column!r}"
        value = _json_object(value, "bad_response_format", where, "a JSON Schema (a JSON object)")
        if value == {}:
            return None
        try:
            rf = ResponseFormat(type="json_schema", json_schema=value)
        except ValidationError as e:  # never a whole job's failure: the row's value is rejected
            raise RowError("bad_response_format", f"{where}: {e.errors()[0]['msg'].removeprefix('Value error, ')}"
                           ) from None
        reason = grammar_error(rf)
        if reason is not None:
            raise RowError("bad_response_format", f"{where} is not a JSON Schema xgrammar can use: {reason}")
        if len(self._formats) < MAX_CACHED:
            self._formats[text] = rf
        warning = unenforced_warning(rf, f"the schema in column {self.format_column!r} of a row (the first such)")
        if warning is not None:
            self.num_unenforced += 1
            if self.warn is not None and self.num_unenforced == 1:
                self.warn(warning)
        return rf

    def _sampling_for(self, columns: dict[str, Any]) -> SamplingParams:
        if self.column is None:
            return self.job
        value = columns.get(self.column)
        if value is None or value == "" or value == {}:
            return self.job
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        params = self._cache.get(text)
        if params is None:
            params = self._parse(value)
            if len(self._cache) < MAX_CACHED:
                self._cache[text] = params
        return params

    def _parse(self, value: Any) -> SamplingParams:
        where = f"column {self.column!r}"
        value = _json_object(value, "bad_sampling", where, "a JSON object of sampling fields")
        value = {k: v for k, v in value.items() if v is not None}  # a null field (a struct column's absent one)
        try:
            params = SamplingParams.model_validate({**self.job.model_dump(exclude_unset=True,
                                                                          exclude={"response_format_column"}),
                                                    **value})
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'value'}: {err['msg']}"
                                 for err in e.errors())
            raise RowError("bad_sampling", f"{where}: {problems}") from None
        if params.n > self.max_samples_per_row:
            raise RowError("bad_sampling", f"{where}: n {params.n} is above limits.max_samples_per_row "
                                           f"({self.max_samples_per_row}); raise the limit in the job file to allow it")
        if self.vocab_size is not None:
            try:
                params.check_vocab(self.vocab_size)
            except ValueError as e:
                raise RowError("bad_sampling", f"{where}: {e}") from None
        changed = [k for k in JOB_WIDE if getattr(params, k) != getattr(self.job, k)]
        if changed:
            raise RowError("bad_sampling", f"{where}: {', '.join(changed)} decide the output columns: set them "
                                           f"in the job's sampling: section, not per row")
        if params.response_format is not None and params.response_format != self.job.response_format:
            from batchgen.sample.grammar import check_response_format  # structured output

            try:
                check_response_format(params.response_format, key=f"{where}: response_format")
            except ValueError as e:
                raise RowError("bad_sampling", str(e)) from None
        return params


def _json_object(value: Any, error_class: str, where: str, what: str) -> dict:
    """A row's value as a JSON object (JSON text is parsed); RowError(error_class) naming `where` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(error_class, f"{where} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise RowError(error_class, f"{where} must hold {what}, got {type(value).__name__}")
    return value

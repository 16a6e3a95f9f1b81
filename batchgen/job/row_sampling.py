"""Per-row sampling settings: `source.sampling_column` names a column holding, for its row, a JSON object (or
its text) of `sampling:` fields that override the job's. Each distinct value is validated once, exactly as the
job's `sampling:` section is (unknown field, wrong type, out of range); a bad one rejects its row as
`bad_sampling` with the field named, and the job goes on. An empty or null value, or a null field, means the
job's settings (Parquet struct columns give absent fields as null).
A row's own `seed` replaces the job's as the root of its samples' seeds.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from batchgen.errors import JobError, RowError
from batchgen.job.spec import JobSpec
from batchgen.sampling_params import SamplingParams

MAX_CACHED = 4096  # distinct values kept parsed (most jobs have a handful)
# settings that decide which output columns exist: job-wide only, a row may not change them
JOB_WIDE = ("logprobs", "prompt_logprobs")


class RowSampling:
    def __init__(self, spec: JobSpec, columns: list[str]) -> None:
        self.column = spec.source.sampling_column
        self.job = spec.sampling
        if self.column is not None and self.column not in columns:
            raise JobError(f"source.sampling_column {self.column!r} is not a column of the source; columns: "
                           f"{', '.join(columns)}")
        self._cache: dict[str, SamplingParams] = {}

    def params_for(self, columns: dict[str, Any]) -> SamplingParams:
        """The row's sampling settings; RowError('bad_sampling') when its value is not valid."""
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
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise RowError("bad_sampling", f"{where} is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise RowError("bad_sampling", f"{where} must hold a JSON object of sampling fields, got "
                                           f"{type(value).__name__}")
        value = {k: v for k, v in value.items() if v is not None}  # a null field (a struct column's absent one)
        try:
            params = SamplingParams.model_validate({**self.job.model_dump(exclude_unset=True), **value})
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'value'}: {err['msg']}"
                                 for err in e.errors())
            raise RowError("bad_sampling", f"{where}: {problems}") from None
        changed = [k for k in JOB_WIDE if getattr(params, k) != getattr(self.job, k)]
        if changed:
            raise RowError("bad_sampling", f"{where}: {', '.join(changed)} decide the output columns: set them "
                                           f"in the job's sampling: section, not per row")
        return params

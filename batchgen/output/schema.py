"""OutputSchema: the columns of data shards (key, sample, kept input columns, completion and counts) and
how an untyped source's values are fitted to them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen.errors import JobError, RowError
from batchgen.job.spec import JobSpec

OUTPUT_COLUMNS = ("row_idx", "sample_idx", "prompt", "completion", "completion_token_ids", "finish_reason",
                  "num_prompt_tokens", "num_completion_tokens", "num_cached_tokens", "seed")


@dataclass(frozen=True)
class OutputSchema:
    key_field: pa.Field  # the key column's field, or row_idx (int64) when rows are keyed by position
    kept: tuple[str, ...]  # source columns copied to every output row
    data: pa.Schema

    @classmethod
    def build(cls, spec: JobSpec, source_schema: pa.Schema) -> OutputSchema:
        kept = _kept_columns(spec, list(source_schema.names))
        key = spec.source.key_column
        key_field = source_schema.field(key) if key else pa.field("row_idx", pa.int64())
        fields = [key_field, pa.field("sample_idx", pa.int32()), *(source_schema.field(c) for c in kept)]
        if spec.output.keep_prompt:
            fields.append(pa.field("prompt", pa.string()))
        fields.append(pa.field("completion", pa.string()))
        if spec.output.keep_token_ids:
            fields.append(pa.field("completion_token_ids", pa.list_(pa.int32())))
        fields += [pa.field("finish_reason", pa.string()),
                   pa.field("num_prompt_tokens", pa.int32()), pa.field("num_completion_tokens", pa.int32()),
                   pa.field("num_cached_tokens", pa.int32()), pa.field("seed", pa.int64())]
        return cls(key_field, tuple(kept), pa.schema(fields))

    def coerce(self, kept: dict[str, Any]) -> dict[str, Any]:
        """Fit an untyped source's values (JSONL) to the schema: text columns take any value (non-text is
        JSON-encoded); a value that fits no other column type rejects the row instead of failing the shard."""
        out = {}
        for name, value in kept.items():
            field_type = self.data.field(name).type
            if value is None or (pa.types.is_string(field_type) and isinstance(value, str)):
                out[name] = value
            elif pa.types.is_string(field_type):
                out[name] = json.dumps(value, ensure_ascii=False, default=str)
            else:
                try:
                    pa.array([value], type=field_type)
                except (pa.ArrowException, TypeError, ValueError, OverflowError):
                    raise RowError("schema_mismatch", f"column {name!r} holds {value!r}, which does not fit the "
                                                      f"column type {field_type} seen in the first rows") from None
                out[name] = value
        return out


def _kept_columns(spec: JobSpec, columns: list[str]) -> list[str]:
    keep = spec.output.keep_columns
    if keep == "all":
        kept = list(columns)
    elif keep == "none":
        kept = []
    else:
        missing = [c for c in keep if c not in columns]
        if missing:
            raise JobError(f"output.keep_columns names {', '.join(missing)}, not column(s) of the source; "
                           f"columns: {', '.join(columns)}")
        kept = list(keep)
    kept = [c for c in kept if c != spec.source.key_column]
    clash = [c for c in kept if c in OUTPUT_COLUMNS]
    if clash and keep != "all":
        raise JobError(f"output.keep_columns {clash} clash with batchgen's output columns; drop them")
    return [c for c in kept if c not in clash]  # with keep_columns: all, batchgen's own columns win

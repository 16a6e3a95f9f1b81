"""OutputSchema: the columns of data shards (key, sample, kept input columns, completion and counts) and
how an untyped source's values are fitted to them."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from batchgen.errors import JobError, RowError
from batchgen.config import JobSpec
from batchgen.output import generation_columns as gen

# a kept column whose field carries this (a JSONL column of objects no one arrow type holds, sources/jsonl.py) is
# string-typed: an object in it is written as its JSON text (keys in the row's order, non-ASCII as it is)
JSON_TEXT_METADATA = {b"batchgen": b"json_text"}

OUTPUT_COLUMNS = ("row_idx", "sample_idx", "prompt", "completion", "completion_token_ids", "finish_reason",
                  "num_prompt_tokens", "num_completion_tokens", "num_cached_tokens", "seed")


@dataclass(frozen=True)
class OutputSchema:
    key_field: pa.Field  # the key column's field, or row_idx (int64) when rows are keyed by position
    kept: tuple[str, ...]  # source columns copied to every output row
    data: pa.Schema

    @classmethod
    def build(cls, spec: JobSpec, source_schema: pa.Schema, reasoning: bool = False) -> OutputSchema:
        """`reasoning`: output.reasoning resolved to markers (the split columns exist)."""
        # the log-prob and reasoning columns clash only where this job writes them (a chained job may keep an
        # upstream's)
        own = OUTPUT_COLUMNS + tuple(f.name for f in gen.reasoning_fields(reasoning) + gen.count_fields(reasoning)
                                     + gen.logprob_fields(spec))
        kept = _kept_columns(spec, list(source_schema.names), own)
        key = spec.source.key_column
        key_field = source_schema.field(key) if key else pa.field("row_idx", pa.int64())
        fields = [key_field, pa.field("sample_idx", pa.int32()), *(source_schema.field(c) for c in kept)]
        if spec.output.keep_prompt:
            fields.append(pa.field("prompt", pa.string()))
        fields.append(pa.field("completion", pa.string()))
        fields += gen.reasoning_fields(reasoning)
        if spec.output.keep_token_ids:
            fields.append(pa.field("completion_token_ids", pa.list_(pa.int32())))
        fields += [pa.field("finish_reason", pa.string()),
                   pa.field("num_prompt_tokens", pa.int32()), pa.field("num_completion_tokens", pa.int32()),
                   *gen.count_fields(reasoning),
                   pa.field("num_cached_tokens", pa.int32()), pa.field("seed", pa.int64()), *gen.logprob_fields(spec)]
        names = [f.name for f in fields]
        if key is not None and names.count(key) > 1:  # a shard with two columns of one name reads as damaged
            raise JobError(f"source.key_column {key!r} is also the name of a column batchgen writes "
                           f"({', '.join(n for n in names[1:] if n not in kept)}): each shard would hold two "
                           f"columns named {key!r}, which no reader can tell apart. Key the job by another column, "
                           f"or rename that column in the source")
        return cls(key_field, tuple(kept), pa.schema(fields))

    def coerce(self, kept: dict[str, Any]) -> dict[str, Any]:
        """Check an untyped source's values (JSONL) against the column types inferred from its first rows:
        a value of another kind (12345 in a text column, "5" or 2.5 in an integer column, an unknown key in an
        object column) rejects the row as `schema_mismatch`. Nothing is converted, but for an object in a JSON text
        column (JSON_TEXT_METADATA), which is written as its JSON text."""
        for name, value in kept.items():
            field = self.data.field(name)
            field_type = field.type
            if isinstance(value, dict) and field.metadata == JSON_TEXT_METADATA:
                kept[name] = json.dumps(value, ensure_ascii=False)
                continue
            if not fits(value, field_type):
                raise RowError("schema_mismatch", f"column {name!r} holds {_short(value)} "
                                                  f"({type(value).__name__}), which does not fit the column type "
                                                  f"{field_type} inferred from the source's first rows; fix the "
                                                  f"value, or leave the column out of output.keep_columns")
        return kept


def as_written(schema: pa.Schema) -> pa.Schema:
    """`schema` as a Parquet file gives it back (timestamp[s] is read as timestamp[ms], date64 as date32, ...)."""
    import io

    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(schema.empty_table(), buffer)
    return pq.read_schema(pa.BufferReader(buffer.getvalue()))


def with_committed_kept_types(data_dir, schema: OutputSchema) -> OutputSchema:
    """A resume's schema checked against the shards already in `data_dir` (one shard's footer is read): the
    shards of one output must read as one table, and JSONL types are inferred at each run. A JSON text column
    (JSON_TEXT_METADATA) that the shards hold as another type takes that type, as the batchgen that began the
    output inferred it (an upgrade alone never blocks a resume); any other kept column of another type, as
    Parquet gives it back, is a JobError naming it (an edited source)."""
    from pathlib import Path

    import pyarrow.parquet as pq

    shards = sorted(Path(data_dir).glob("*.parquet"))
    if not shards:
        return schema
    try:
        committed = pq.read_schema(shards[0])
    except (OSError, pa.ArrowException):
        return schema  # damage is verify's and the records' to report
    written = as_written(schema.data)
    fields = list(schema.data)
    for name in schema.kept:
        if name not in committed.names or committed.field(name).type == written.field(name).type:
            continue
        i = schema.data.get_field_index(name)
        if fields[i].metadata == JSON_TEXT_METADATA:
            fields[i] = pa.field(name, committed.field(name).type)
            continue
        raise JobError(f"output.keep_columns: column {name!r} is {committed.field(name).type} in the shards "
                       f"already written ({shards[0].name}) but {written.field(name).type} as this run reads the "
                       f"source; one output's shards share one schema. Restore the source, start over with "
                       f"--fresh, or give this run another output.dir")
    return replace(schema, data=pa.schema(fields))


def key_type_error(key_column: str, key: Any, position: int, key_type: pa.DataType) -> str:
    """Why a JSONL row's key does not fit the key column's type inferred from the first rows (fits is False)."""
    if isinstance(key, int) and not isinstance(key, bool) and not _in_range(key, pa.int64()):
        return (f"source.key_column {key_column!r} holds {key} at row {position}, an integer outside the 64-bit "
                f"range keys are stored in; write such keys as strings (every key of the column)")
    return (f"source.key_column {key_column!r} holds {key!r} at row {position}, but its first rows hold {key_type} "
            f"keys; keys must all be strings or all integers")


def fits(value: Any, t: pa.DataType) -> bool:
    """Whether a JSON value (None, bool, int, float, str, list, dict) fits arrow type `t` as it is: no
    truncation (2.5 into int64), no bool-as-number, no dropped keys. Null fits every type."""
    if value is None:
        return True
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return isinstance(value, str)
    if pa.types.is_boolean(t):
        return isinstance(value, bool)
    if pa.types.is_integer(t):
        return isinstance(value, int) and not isinstance(value, bool) and _in_range(value, t)
    if pa.types.is_floating(t):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return isinstance(value, list) and all(fits(v, t.value_type) for v in value)
    if pa.types.is_struct(t):
        names = {f.name for f in t}
        return isinstance(value, dict) and set(value) <= names and all(fits(value.get(f.name), f.type) for f in t)
    try:  # a type JSON inference does not produce: let arrow decide
        pa.array([value], type=t)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return False
    return True


def _in_range(value: int, t: pa.DataType) -> bool:
    try:
        pa.scalar(value, type=t)
    except (pa.ArrowException, OverflowError):
        return False
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _kept_columns(spec: JobSpec, columns: list[str], own: tuple[str, ...]) -> list[str]:
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
    clash = [c for c in kept if c in own]
    if clash and keep != "all":
        raise JobError(f"output.keep_columns {clash} clash with batchgen's output columns; drop them")
    return [c for c in kept if c not in clash]  # with keep_columns: all, batchgen's own columns win

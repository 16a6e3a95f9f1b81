"""A JSONL column of objects whose shapes no one Arrow type holds ({"stop": "e"} and {"stop": ["a", "b"]}, a
schema's `enum: [1, "high"]`, an int beyond 64 bits inside an object) is a JSON text column: each row's object
kept as its JSON text, so every row fits it; templates and per-row sampling and response formats still see the
object.
Where the objects do unify, or the column is not mostly objects, the types are inferred as before."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.config import SourceSpec
from batchgen.sources import open_source
from batchgen.output.schema import JSON_TEXT_METADATA, OutputSchema
from batchgen.prompts import RowError
from batchgen.sources.jsonl import column_type, json_text_column
from jobutil import read_rows, seed_rows, write_job, write_jsonl

runner = CliRunner()

CLASHING_SAMPLING = [{"stop": "e"}, {"stop": ["a", "b"]}, {"temperature": 0.2}, {"n": 2}, None]


def test_objects_whose_shapes_clash_make_a_json_text_column_and_unifying_ones_keep_their_type():
    for values in (CLASHING_SAMPLING,
                   [{"enum": [1, "high"]}],  # not even one object has an arrow type
                   [{"seed": 1}, {"seed": 2 ** 70}],  # an int beyond 64 bits inside an object
                   [{"a": 1}, {"a": "1"}, "x"]):  # mostly objects (a tie: the first seen kind)
        assert column_type(values) == pa.string(), values
        assert json_text_column(values), values
    # types that unify, and columns that are not mostly objects, are inferred as before
    unified = [{"stop": "e"}, {"temperature": 0.2}, {"n": 2}, None]
    assert column_type(unified) == pa.struct([("stop", pa.string()), ("temperature", pa.float64()),
                                              ("n", pa.int64())])
    messages = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]]
    assert column_type(messages) == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert column_type(["five", 5, 6, 7]) == pa.int64() and column_type([1, 2 ** 70]) == pa.int64()
    assert column_type([{"a": 1}, "x", "y"]) == pa.string()
    assert not any(json_text_column(v) for v in (unified, messages, ["five", 5, 6, 7], [1, 2 ** 70],
                                                 [{"a": 1}, "x", "y"], [None, None]))


def test_the_source_marks_a_json_text_column_and_keeps_its_rows_objects_for_templates(tmp_path):
    values = [{"stop": "e"}, {"stop": ["a", "b"]}, {"note": "café"}, '{"n": 3}', None, 5]
    write_jsonl(tmp_path / "rows.jsonl", [{"id": f"r{i}", "samp": v} for i, v in enumerate(values)])
    source = open_source(SourceSpec(path=str(tmp_path / "rows.jsonl"), key_column="id"))
    field = source.schema.field("samp")
    assert field.type == pa.string() and field.metadata == JSON_TEXT_METADATA
    assert source.schema.field("id").metadata is None
    assert [row.columns["samp"] for row in source] == values  # a template reads {{ samp.stop }} as before
    # kept, an object is written as its JSON text; a string as it is; a number still does not fit
    schema = OutputSchema(pa.field("id", pa.string()), ("samp",), pa.schema([source.schema.field("id"), field]))
    assert schema.coerce({"samp": {"note": "café"}}) == {"samp": '{"note": "café"}'}
    assert schema.coerce({"samp": '{"n": 3}'}) == {"samp": '{"n": 3}'}
    with pytest.raises(RowError, match="schema_mismatch|does not fit"):
        schema.coerce({"samp": 5})
    # object keys are never JSON text (a key must be a string or an integer: the job refuses it, as before)
    write_jsonl(tmp_path / "keys.jsonl", [{"id": {"a": 1}}, {"id": {"a": "x"}}])
    keys = open_source(SourceSpec(path=str(tmp_path / "keys.jsonl"), key_column="id"))
    assert keys.schema.field("id").metadata is None and [r.columns["id"] for r in keys] == [{"a": 1}, {"a": "x"}]


def test_a_sampling_column_of_clashing_objects_generates_every_row_and_keeps_them_as_json_text(
        tmp_path, tiny_model_dir):
    rows = seed_rows(len(CLASHING_SAMPLING))
    for r, samp in zip(rows, CLASHING_SAMPLING):
        r["samp"] = samp  # objects (and a null) as they are in the line, not their text
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id", "sampling_column": "samp"},
                    sampling={"temperature": 0.8})  # output.keep_columns: all (the default) keeps samp
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert read_rows(tmp_path / "out", "rejects") == []
    by_key: dict[str, list[dict]] = {}
    for r in read_rows(tmp_path / "out"):
        by_key.setdefault(r["id"], []).append(r)
    assert sorted(by_key) == [r["id"] for r in rows]
    assert [len(by_key[r["id"]]) for r in rows] == [1, 1, 1, 2, 1]  # {"n": 2} read from its JSON text
    assert "e" not in by_key["row-0000"][0]["completion"]  # the row's own stop strings applied
    assert not {"a", "b"} & set(by_key["row-0001"][0]["completion"])
    for r, samp in zip(rows, CLASHING_SAMPLING):
        for out in by_key[r["id"]]:
            assert (json.loads(out["samp"]) if out["samp"] is not None else None) == samp
    table = pq.read_table(sorted((tmp_path / "out" / "data").glob("*.parquet"))[0])
    assert table.schema.field("samp").type == pa.string()


def test_a_resume_whose_kept_column_reads_as_another_type_is_refused_naming_it(tmp_path, tiny_model_dir):
    """JSONL types are inferred at each run: a source edited so that a kept column's type changes (as an output
    begun by an earlier batchgen whose inference differed) would write shards that no longer read as one table."""
    rows = seed_rows(4)
    for r in rows:
        r["meta"] = {"lang": "en"}
    write_jsonl(tmp_path / "rows.jsonl", rows[:2])
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"})
    assert runner.invoke(app, ["run", str(job), "--no-progress"]).exit_code == 0
    rows[2]["meta"] = {"lang": ["en", "fr"]}  # the first rows' objects no longer unify: a JSON text column
    write_jsonl(tmp_path / "rows.jsonl", rows)
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "column 'meta' is struct<lang: string> in the shards already written" in result.output
    assert "but string as this run reads the source" in result.output
    assert len(read_rows(tmp_path / "out")) == 2  # nothing written under the new type

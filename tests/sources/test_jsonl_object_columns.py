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


def test_a_resume_keeps_the_shards_type_for_a_json_text_column_and_refuses_another_changed_type(
        tmp_path, tiny_model_dir):
    """JSONL types are inferred at each run. A column whose objects clash now (a JSON text column) but were one
    struct when the output began (an earlier batchgen, or an edited source) keeps the shards' struct: an upgrade
    alone never blocks a resume, and the clashing row is a schema_mismatch reject as it was then. Any other kept
    column whose type changed would write shards that no longer read as one table: refused, naming it."""
    rows = seed_rows(4)
    for r in rows:
        r["meta"] = {"lang": "en"}
    write_jsonl(tmp_path / "rows.jsonl", rows[:2])
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"})
    assert runner.invoke(app, ["run", str(job), "--no-progress"]).exit_code == 0
    rows[2]["meta"] = {"lang": ["en", "fr"]}  # the first rows' objects no longer unify: a JSON text column
    write_jsonl(tmp_path / "rows.jsonl", rows)
    for command in ("validate", "run"):
        result = runner.invoke(app, [command, str(job), *(["--no-progress"] if command == "run" else [])])
        assert result.exit_code == 0, result.output
    assert sorted(r["id"] for r in read_rows(tmp_path / "out")) == ["row-0000", "row-0001", "row-0003"]
    assert [r["error_class"] for r in read_rows(tmp_path / "out", "rejects")] == ["schema_mismatch"]
    assert {pq.read_schema(p).field("meta").type for p in (tmp_path / "out" / "data").glob("*.parquet")} == {
        pa.struct([("lang", pa.string())])}
    for r in rows:
        r["level"] = str(r["level"])  # an integer column now text: refused by validate and by run
    rows.append({**seed_rows(5)[4], "meta": {"lang": "en"}, "level": "x"})
    write_jsonl(tmp_path / "rows.jsonl", rows)
    for command in ("validate", "run"):
        result = runner.invoke(app, [command, str(job), *(["--no-progress"] if command == "run" else [])])
        assert result.exit_code == 2, result.output
        assert "column 'level' is int64 in the shards already written" in result.output
        assert "but string as this run reads the source" in result.output
    assert len(read_rows(tmp_path / "out")) == 3  # nothing written under the new type


def test_a_resume_of_an_unchanged_job_keeping_a_type_parquet_stores_otherwise_goes_on(tmp_path, tiny_model_dir):
    """timestamp[s] is written to Parquet as timestamp[ms] (date64 as date32): compared as written, an unchanged
    datasets job that keeps such a column resumes (it was refused naming the column)."""
    datasets = pytest.importorskip("datasets")
    import datetime

    rows = seed_rows(6)
    for r in rows:
        r["when"], r["day"] = datetime.datetime(2024, 1, 1), datetime.date(2024, 1, 2)
    features = datasets.Features({"id": datasets.Value("string"), "topic": datasets.Value("string"),
                                  "level": datasets.Value("int64"), "when": datasets.Value("timestamp[s]"),
                                  "day": datasets.Value("date64")})
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    for limit in (3, None):  # the same job, then all its rows
        job = write_job(tmp_path, tiny_model_dir, {"path": "ds", "key_column": "id", "limit": limit})
        result = runner.invoke(app, ["run", str(job), "--no-progress"])
        assert result.exit_code == 0, result.output
    assert len(read_rows(tmp_path / "out")) == 6

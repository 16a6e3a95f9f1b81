"""Structured output through `batchgen run` / `validate` (tiny model): a per-row schema column, its broken rows
rejected as bad_response_format while the others complete; a schema, regex or grammar xgrammar refuses stops
the job before the model loads, naming the key; a missing column is refused; the fingerprint refuses a resume
with another format; OpenAI batch lines' response_format is honoured."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows, seed_rows, write_job, write_jsonl

runner = CliRunner()
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"]}


def _run(job, *extra):
    return runner.invoke(app, ["run", str(job), "--no-progress", *extra])


@pytest.fixture
def rows_job(tmp_path, tiny_model_dir):
    rows = seed_rows(7)
    for i, r in enumerate(rows):  # row 6: the text of an empty object, empty as null is (it once failed the job)
        r["schema"] = {1: "{not json", 3: '{"type": "objekt"}', 4: None, 6: "{}"}.get(i, json.dumps(SCHEMA))
    write_jsonl(tmp_path / "rows.jsonl", rows)

    def make(**sampling):
        return write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                         sampling={"max_new_tokens": 40, "temperature": 1.0, **sampling})
    return make


def test_response_format_column_rejects_broken_schemas_and_completes_the_other_rows(rows_job, tmp_path):
    job = rows_job(response_format_column="schema", response_format={"type": "regex", "regex": "[a-z]{2,5}"})
    result = _run(job)
    assert result.exit_code == 0, result.output
    done = {r["id"]: r for r in read_rows(tmp_path / "out")}
    rejects = {r["id"]: r for r in read_rows(tmp_path / "out", "rejects")}
    assert sorted(done) == ["row-0000", "row-0002", "row-0004", "row-0005", "row-0006"]
    assert {k: r["error_class"] for k, r in rejects.items()} == {"row-0001": "bad_response_format",
                                                                  "row-0003": "bad_response_format"}
    assert "is not JSON" in rejects["row-0001"]["message"]
    assert 'xgrammar can use: Unsupported type "objekt"' in rejects["row-0003"]["message"]
    for key in ("row-0000", "row-0002", "row-0005"):
        assert done[key]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(done[key]["completion"]), SCHEMA)
    for key in ("row-0004", "row-0006"):  # null and "{}": the job's response_format
        assert re.fullmatch("[a-z]{2,5}", done[key]["completion"])


@pytest.mark.parametrize("response_format, key, reason", [
    ({"type": "regex", "regex": "[a-z"}, "sampling.response_format.regex", "Unclosed '\\['"),
    ({"type": "json_schema", "json_schema": {"type": "objekt"}}, "sampling.response_format.json_schema",
     'Unsupported type "objekt"'),
    ({"type": "grammar", "grammar": 'root ::= "a" |'}, "sampling.response_format.grammar", "EBNF parser error"),
])
def test_a_format_xgrammar_refuses_stops_run_and_validate_before_the_model_loads(rows_job, tmp_path,
                                                                                response_format, key, reason):
    job = rows_job(response_format=response_format)
    for command in (["run", str(job), "--no-progress"], ["validate", str(job)]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, result.output
        assert re.search(f"{re.escape(key)}: xgrammar cannot use it: .*{reason}", result.output), result.output
    assert not (tmp_path / "out").exists()


def test_response_format_column_naming_a_missing_column_is_refused(rows_job):
    result = _run(rows_job(response_format_column="schemas"))
    assert result.exit_code == 2
    assert "sampling.response_format_column 'schemas' is not a column of the source" in result.output


def test_validate_counts_the_rows_a_run_would_reject_for_their_schema(rows_job):
    result = runner.invoke(app, ["validate", str(rows_job(response_format_column="schema"))])
    assert result.exit_code == 0, result.output
    assert "bad_response_format: 2" in result.output and "response_format_column='schema'" in result.output


def test_resume_with_another_response_format_is_refused_naming_it(rows_job):
    assert _run(rows_job(response_format={"type": "choice", "choices": ["yes", "no"]})).exit_code == 0
    result = _run(rows_job(response_format={"type": "choice", "choices": ["yes", "no", "maybe"]}))
    assert result.exit_code == 2 and "sampling.response_format.choices" in result.output
    result = _run(rows_job())
    assert result.exit_code == 2 and "sampling.response_format" in result.output


def test_openai_batch_lines_response_format_json_object_and_json_schema_are_honoured(tmp_path, tiny_model_dir):
    chat = [{"role": "user", "content": "Give me JSON."}]
    wrapped = {"type": "json_schema", "json_schema": {"name": "card", "strict": True, "schema": SCHEMA}}
    lines = [{"custom_id": "obj", "body": {"messages": chat, "response_format": {"type": "json_object"}}},
             {"custom_id": "schema", "body": {"messages": chat, "response_format": wrapped}},
             {"custom_id": "text", "body": {"messages": chat, "response_format": {"type": "text"}}},
             {"custom_id": "bad", "body": {"messages": chat, "response_format": {
                 "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}}]
    (tmp_path / "batch.jsonl").write_text("".join(
        json.dumps({"method": "POST", "url": "/v1/chat/completions", **line}) + "\n" for line in lines))
    job = {"model": {"path": tiny_model_dir, "device": "cpu"}, "source": {"path": "batch.jsonl"},
           "sampling": {"max_new_tokens": 60, "temperature": 1.0},
           "engine": {"max_num_seqs": 8, "num_kv_blocks": 256, "block_size": 8}, "output": {"dir": "out"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    result = _run(tmp_path / "job.yaml")
    assert result.exit_code == 0, result.output
    done = {r["custom_id"]: r for r in read_rows(tmp_path / "out")}
    assert isinstance(json.loads(done["obj"]["completion"]), dict) and done["obj"]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(done["schema"]["completion"]), SCHEMA)
    assert "text" in done
    (bad,) = read_rows(tmp_path / "out", "rejects")
    assert bad["custom_id"] == "bad" and bad["error_class"] == "bad_sampling"
    assert "response_format.json_schema: xgrammar cannot use it" in bad["message"]


def test_run_and_validate_name_the_schema_keywords_xgrammar_does_not_enforce(tmp_path, tiny_model_dir):
    """A schema carrying `not` / `uniqueItems` runs (they are often documentation), but both commands say that the
    completions are generated without them, naming where they sit; a row's schema is named once a run."""
    rows = seed_rows(4)
    for i, r in enumerate(rows):
        r["schema"] = json.dumps({**SCHEMA, "not": {"required": [f"x{i}"]}}) if i % 2 else None
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"max_new_tokens": 24, "response_format_column": "schema", "response_format": {
                        "type": "json_schema", "json_schema": {
                            "type": "object", "properties": {"t": {"type": "array", "uniqueItems": True,
                                                                  "items": {"type": "integer"}}}}}})
    validated = runner.invoke(app, ["validate", str(job)])
    assert validated.exit_code == 0, validated.output
    assert ("warning: sampling.response_format.json_schema uses keywords xgrammar does not enforce: 'uniqueItems' "
            "at /properties/t. Completions are generated as if they were absent") in validated.output
    assert ("warning: 2 distinct schema(s) of the sampled rows' sampling.response_format_column 'schema' use "
            "keywords xgrammar does not enforce") in validated.output
    ran = _run(job)
    assert ran.exit_code == 0, ran.output
    assert ran.output.count("'uniqueItems' at /properties/t") == 1
    assert ran.output.count("batchgen: warning: the schema in column 'schema' of a row (the first such) uses "
                            "keywords xgrammar does not enforce: 'not' at /") == 1
    assert len(read_rows(tmp_path / "out")) == 4

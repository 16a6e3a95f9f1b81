"""`validate` checks the keys of rows the source could not parse the way `run` keys them (job/loop.py _key): an
OpenAI batch line that is not a request (method GET) but repeats an earlier custom_id is the same duplicate-key
refusal (exit 2, naming the key and both rows) before any run, not a pass followed by a run that stops after
committing rows, on every rerun."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from batchgen.cli import app

runner = CliRunner()


def _job(tmp_path, model_dir, last_id):
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 3}} for i in range(4)]
    lines.append({"custom_id": last_id, "method": "GET", "url": "/v1/chat/completions", "body": {}})
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = {"model": {"path": model_dir, "device": "cpu"}, "source": {"path": "b.jsonl"},
           "sampling": {"max_new_tokens": 4, "temperature": 0.0},
           "engine": {"max_num_seqs": 8, "num_kv_blocks": 256, "block_size": 8},
           "output": {"dir": "out", "report": False, "rows_per_shard": 1}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return str(tmp_path / "job.yaml")


def test_validate_refuses_a_malformed_line_repeating_a_custom_id_as_run_does(tmp_path, tiny_model_dir):
    job = _job(tmp_path, tiny_model_dir, "r1")
    validated = runner.invoke(app, ["validate", job])
    assert validated.exit_code == 2, validated.output
    assert "duplicate key 'r1' (rows 1 and 4)" in validated.output, validated.output
    assert "custom_ids must be unique" in validated.output and "drop key_column" not in validated.output  # not set
    ran = runner.invoke(app, ["run", job, "--no-progress"])
    assert ran.exit_code == 2 and "duplicate key 'r1' (rows 1 and 4)" in ran.output  # the same refusal


def test_validate_passes_a_malformed_line_with_its_own_custom_id_and_run_rejects_it(tmp_path, tiny_model_dir):
    job = _job(tmp_path, tiny_model_dir, "r9")
    validated = runner.invoke(app, ["validate", job])
    assert validated.exit_code == 0 and "malformed_row: 1" in validated.output, validated.output
    ran = runner.invoke(app, ["run", job, "--no-progress"])
    assert ran.exit_code == 0 and "(1 rejected)" in ran.output, ran.output

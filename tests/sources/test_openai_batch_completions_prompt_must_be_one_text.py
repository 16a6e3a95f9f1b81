"""/v1/completions batch lines: body.prompt is the prompt's text, or a list of one text (OpenAI's one prompt, the
same request); a list of several prompts, token ids, an object or a number is a `malformed_row` reject naming
body.prompt and what it holds, never generated from its Python repr."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows

runner = CliRunner()

PROMPTS = {"c1": "Once upon", "c2": ["first prompt", "second prompt"], "c3": [1, 2, 3], "c4": {"a": 1},
           "c5": ["Once upon"], "c6": [[1, 2], [3]], "c7": 7, "c8": []}


def test_a_completions_prompt_that_is_not_one_text_is_rejected_naming_body_prompt(tmp_path, tiny_model_dir):
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(
        {"custom_id": k, "method": "POST", "url": "/v1/completions", "body": {"prompt": p, "max_tokens": 3}}) + "\n"
        for k, p in PROMPTS.items()))
    job = {"model": {"path": tiny_model_dir, "device": "cpu"}, "source": {"path": "b.jsonl"},
           "sampling": {"max_new_tokens": 4, "temperature": 0.0},
           "engine": {"max_num_seqs": 8, "num_kv_blocks": 256, "block_size": 8},
           "output": {"dir": "out", "report": False, "keep_prompt": True}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    result = runner.invoke(app, ["run", str(tmp_path / "job.yaml"), "--no-progress"])
    assert result.exit_code == 0, result.output
    generated = {r["custom_id"]: r["prompt"] for r in read_rows(tmp_path / "out")}
    assert generated == {"c1": "Once upon", "c5": "Once upon"}  # a list of one prompt is that prompt
    rejects = {r["custom_id"]: r for r in read_rows(tmp_path / "out", "rejects")}
    assert sorted(rejects) == ["c2", "c3", "c4", "c6", "c7", "c8"]
    assert all(r["error_class"] == "malformed_row" and "body.prompt holds" in r["message"] for r in rejects.values())
    assert "a list of 2 prompts" in rejects["c2"]["message"]
    assert "token ids" in rejects["c3"]["message"] and "token ids" in rejects["c6"]["message"]
    assert "an object" in rejects["c4"]["message"] and "a number" in rejects["c7"]["message"]
    assert "an empty list" in rejects["c8"]["message"] and "line 8 of" in rejects["c8"]["message"]

"""An OpenAI batch line whose custom_id is not a non-empty string (null, a number, an object, "") is a
`malformed_row` reject naming custom_id and its line, keyed by its position like a line without a custom_id:
never generated under the text of the value ("None"), so it never collides with a real custom_id "None"."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.config import SourceSpec
from batchgen.sources import open_source
from jobutil import read_rows

runner = CliRunner()
CHAT = [{"role": "user", "content": "hi"}]


def _line(custom_id, **extra):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": CHAT, "max_tokens": 3}, **extra}


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_custom_id_that_is_no_non_empty_string_is_a_malformed_line_naming_custom_id_and_its_line(tmp_path):
    path = _write(tmp_path / "b.jsonl", [_line("ok"), _line(None), _line(5), _line({"a": 1}), _line(""),
                                         _line(7, method="GET")])
    (tmp_path / "b.jsonl").write_text((tmp_path / "b.jsonl").read_text().replace("\n", "\n\n", 1))  # a blank line
    rows = list(open_source(SourceSpec(path=str(path), type="openai_batch")))
    assert rows[0].columns["custom_id"] == "ok"
    for row, number, held in zip(rows[1:5], (3, 4, 5, 6), ("null", "a number", "an object", "an empty string")):
        assert row.columns is None and row.key is None, row  # keyed by its position, as a line without one
        assert f"line {number} of {path}" in row.error and f"custom_id holds {held}" in row.error, row.error
    assert rows[5].columns is None and rows[5].key is None  # a malformed line's number is no key either


def test_a_null_custom_id_is_rejected_by_position_beside_a_real_custom_id_None(tmp_path, tiny_model_dir):
    _write(tmp_path / "b.jsonl", [_line("ok-1"), _line(None), _line("None")])
    job = {"model": {"path": tiny_model_dir, "device": "cpu"}, "source": {"path": "b.jsonl"},
           "sampling": {"max_new_tokens": 4, "temperature": 0.0},
           "engine": {"max_num_seqs": 8, "num_kv_blocks": 256, "block_size": 8},
           "output": {"dir": "out", "report": False}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    validated = runner.invoke(app, ["validate", str(tmp_path / "job.yaml")])
    assert validated.exit_code == 0 and "malformed_row: 1" in validated.output, validated.output
    result = runner.invoke(app, ["run", str(tmp_path / "job.yaml"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert sorted(r["custom_id"] for r in read_rows(tmp_path / "out")) == ["None", "ok-1"]  # the real one only
    [reject] = read_rows(tmp_path / "out", "rejects")
    assert reject["error_class"] == "malformed_row" and reject["row_position"] == 1
    assert reject["custom_id"] == "<unparsed row 1>" and "custom_id holds null" in reject["message"]
    assert "line 2 of" in reject["message"]

"""`batchgen export --format openai --to F --errors F`: one file named by both options (the same spelling, another
spelling, a symbolic link, a hard link) is refused with exit 2 naming both options, before anything is written:
otherwise the error lines replace the results and the export says it succeeded."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import write_job, write_jsonl

runner = CliRunner()
BEFORE = "what the user had here\n"


@pytest.fixture(scope="module")
def out(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("export_same_file")
    rows = [{"id": f"k-{i}", "topic": t, "level": 1} for i, t in enumerate(["the sea", "bread", None])]  # a reject
    write_jsonl(tmp / "rows.jsonl", rows)
    job = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"max_new_tokens": 4}, output={"report": False})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    return tmp / "out"


def _spellings(d):
    """(--to, --errors) pairs that name one file, made in the folder d."""
    (d / "sub").mkdir()
    (d / "results.jsonl").write_text(BEFORE)
    (d / "link.jsonl").symlink_to(d / "results.jsonl")
    os.link(d / "results.jsonl", d / "hard.jsonl")
    return {"same path": (d / "results.jsonl", d / "results.jsonl"),
            "another spelling": (d / "results.jsonl", d / "sub" / ".." / "results.jsonl"),
            "a symbolic link": (d / "results.jsonl", d / "link.jsonl"),
            "a hard link": (d / "hard.jsonl", d / "results.jsonl")}


@pytest.mark.parametrize("how", ["same path", "another spelling", "a symbolic link", "a hard link"])
def test_to_and_errors_naming_one_file_is_refused_before_anything_is_written(out, tmp_path, how):
    to, errors = _spellings(tmp_path)[how]
    listing = sorted(p.name for p in tmp_path.iterdir())
    result = runner.invoke(app, ["export", str(out), "--format", "openai", "--to", str(to), "--errors", str(errors)])
    assert result.exit_code == 2, result.output
    assert "--to" in result.output and "--errors" in result.output and "name the same file" in result.output
    assert (tmp_path / "results.jsonl").read_text() == BEFORE  # nothing written over it
    assert (tmp_path / "link.jsonl").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no file made, no temporary file left


def test_to_and_errors_naming_two_files_still_export_every_row_once(out, tmp_path):
    result = runner.invoke(app, ["export", str(out), "--format", "openai", "--to", str(tmp_path / "r.jsonl"),
                                 "--errors", str(tmp_path / "e.jsonl")])
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["k-0", "k-1"] and [x["custom_id"] for x in errors] == ["k-2"]

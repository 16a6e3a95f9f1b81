"""`batchgen export`'s destinations. A failed export leaves no hidden `.NAME.<pid>.tmp` copy of the export behind
(every format), whether it fails on a destination that is a folder or in a folder that does not exist (refused,
exit 2, naming the option), a full disk while the file is written or renamed (exit 1), or Ctrl-C; a failure
writing `--errors` does not leave `--to` replaced either. One file named by both `--to` and `--errors` (the same
spelling, another spelling, a symbolic link, a hard link) is refused with exit 2 naming both options, before
anything is written: otherwise the error lines replace the results and the export says it succeeded."""

from __future__ import annotations

import errno
import json
import os

import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.output import export as export_mod
from jobutil import write_job, write_jsonl

runner = CliRunner()
BEFORE = "what the user had here\n"


@pytest.fixture(scope="module")
def out(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("export_tmp_files")
    rows = [{"id": f"k-{i}", "topic": t, "level": 1} for i, t in enumerate(["the sea", "bread", None])]  # a reject
    write_jsonl(tmp / "rows.jsonl", rows)
    job = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"max_new_tokens": 4}, output={"report": False})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    return tmp / "out"


def _leftovers(folder):
    return sorted(p.name for p in folder.rglob(".*.tmp"))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "openai"])
def test_a_folder_as_to_is_refused_naming_the_option_and_leaves_no_temporary_file(out, tmp_path, fmt):
    (tmp_path / "exports").mkdir()
    result = runner.invoke(app, ["export", str(out), "--format", fmt, "--to", str(tmp_path / "exports")])
    assert result.exit_code == 2, result.output
    assert "--to" in result.output and "is a folder" in result.output
    assert _leftovers(tmp_path) == [] and list((tmp_path / "exports").iterdir()) == []


def test_a_folder_as_errors_is_refused_and_to_is_not_written(out, tmp_path):
    (tmp_path / "errors").mkdir()
    result = runner.invoke(app, ["export", str(out), "--format", "openai", "--to", str(tmp_path / "r.jsonl"),
                                 "--errors", str(tmp_path / "errors")])
    assert result.exit_code == 2, result.output
    assert "--errors" in result.output and "is a folder" in result.output
    assert _leftovers(tmp_path) == [] and not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("option", ["--to", "--errors"])
def test_a_destination_in_a_missing_folder_is_refused_naming_the_option_and_the_folder(out, tmp_path, option):
    paths = {"--to": tmp_path / "r.jsonl", "--errors": tmp_path / "e.jsonl", option: tmp_path / "missing" / "x.jsonl"}
    result = runner.invoke(app, ["export", str(out), "--format", "openai", "--to", str(paths["--to"]), "--errors",
                                 str(paths["--errors"])])
    assert result.exit_code == 2, result.output
    assert f"{option} {paths[option]}: the folder {tmp_path / 'missing'} does not exist" in result.output
    assert ".tmp" not in result.output and list(tmp_path.iterdir()) == []


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "openai"])
@pytest.mark.parametrize("where", ["rename", "write"])
def test_a_full_disk_leaves_no_temporary_file_and_no_destination(out, tmp_path, monkeypatch, fmt, where):
    if where == "rename":
        monkeypatch.setattr(export_mod.os, "replace", _disk_full)
    elif fmt == "parquet":
        monkeypatch.setattr(export_mod.pq, "write_table", lambda table, path: (path.write_bytes(b"PAR1"),
                                                                                _disk_full()))
    else:
        real_open = open

        class Full:  # opens the temporary file, writes nothing whole
            def __init__(self, path, mode):
                self.f = real_open(path, mode)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, text):
                self.f.write(text[:3])
                _disk_full()

        monkeypatch.setattr(export_mod, "open", Full, raising=False)
    to = tmp_path / f"all.{fmt}"
    result = runner.invoke(app, ["export", str(out), "--format", fmt, "--to", str(to)])
    assert result.exit_code == 1 and "No space left on device" in result.output, result.output
    assert _leftovers(tmp_path) == [] and not to.exists()


def test_a_failure_writing_errors_leaves_to_as_it_was_and_no_temporary_file(out, tmp_path, monkeypatch):
    (tmp_path / "r.jsonl").write_text("before\n")
    real_open = open

    def full_for_errors(path, mode="r", *args, **kwargs):
        if "e.jsonl" in str(path) and "w" in mode:
            real_open(path, mode).close()  # the temporary file is made, then the disk is full
            _disk_full()
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(export_mod, "open", full_for_errors, raising=False)
    result = runner.invoke(app, ["export", str(out), "--format", "openai", "--to", str(tmp_path / "r.jsonl"),
                                 "--errors", str(tmp_path / "e.jsonl")])
    assert result.exit_code == 1 and "No space left on device" in result.output, result.output
    assert (tmp_path / "r.jsonl").read_text() == "before\n" and not (tmp_path / "e.jsonl").exists()
    assert _leftovers(tmp_path) == []


def test_ctrl_c_during_an_export_leaves_no_temporary_file(out, tmp_path, monkeypatch):
    def interrupted(table, path):
        path.write_bytes(b"PAR1")
        raise KeyboardInterrupt

    monkeypatch.setattr(export_mod.pq, "write_table", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_mod.export(out, "parquet", tmp_path / "all.parquet")
    assert _leftovers(tmp_path) == [] and not (tmp_path / "all.parquet").exists()



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

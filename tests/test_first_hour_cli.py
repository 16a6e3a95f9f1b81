"""Issue 17, a new user's first hour: `--version`; `validate` prints resolved paths; the `output:` section is
optional; a failed start leaves no lock-only folder behind."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

import batchgen
from batchgen.cli import app
from batchgen.job.spec import load_spec
from jobutil import seed_rows, write_job, write_jsonl

runner = CliRunner()


def _cli(*args):
    return runner.invoke(app, [*map(str, args)])


def _job(tmp_path, model, rows=6, with_output=True, job_name=None, **sections):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(rows))
    job = write_job(tmp_path, model, {"path": "rows.jsonl", "key_column": "id"}, **sections)
    raw = yaml.safe_load(job.read_text())
    if not with_output:
        del raw["output"]
    if job_name is not None:
        raw["name"] = job_name
    job.write_text(yaml.safe_dump(raw))
    return job


def test_version_flag_prints_batchgen_version():
    result = _cli("--version")
    assert result.exit_code == 0 and result.output.strip() == f"batchgen {batchgen.__version__}"


def test_without_an_output_section_the_output_is_out_name_next_to_the_job_file(tmp_path, tiny_model_dir,
                                                                              monkeypatch):
    job = _job(tmp_path, tiny_model_dir, with_output=False, job_name="demo")
    result = _cli("validate", job)
    assert result.exit_code == 0, result.output
    assert f"output -> {tmp_path / 'out' / 'demo'}" in result.output
    job.write_text(job.read_text().replace("name: demo\n", ""))
    assert load_spec(job).output.dir == str(tmp_path / "out" / "job")  # no name: the job file's stem
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert load_spec(job, output_dir="here").output.dir == str(tmp_path / "cwd" / "here")  # -o: current folder


def test_validate_prints_normalised_paths(tmp_path, tiny_model_dir):
    (tmp_path / "jobs").mkdir()
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    job = write_job(tmp_path / "jobs", tiny_model_dir, {"path": "../rows.jsonl"}, output={"dir": "../out/x"})
    result = _cli("validate", job)
    assert result.exit_code == 0, result.output
    assert f"output -> {tmp_path / 'out' / 'x'}" in result.output and f"({tmp_path / 'rows.jsonl'})" in result.output
    assert "/../" not in result.output


def test_a_run_that_fails_at_start_leaves_no_output_folder_behind(tmp_path, tiny_model_dir):
    job = _job(tmp_path, str(tmp_path / "no-model"), with_output=False)
    result = _cli("run", job, "--no-progress")
    assert result.exit_code == 2 and "cannot load model.path" in result.output
    assert not (tmp_path / "out").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert _cli("run", job, "--no-progress", "-o", kept).exit_code == 2
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]  # its lock file removed, the rest untouched

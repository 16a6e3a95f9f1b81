"""Issue 17, a new user's first hour: `--version`; `validate` refuses what `run` would refuse (keep_columns,
duplicate or null keys, a fingerprint change) and prints resolved paths; the `output:` section is optional;
a failed start leaves no lock-only folder behind."""

from __future__ import annotations

import pytest
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


def test_validate_refuses_keep_columns_that_are_not_in_the_source(tmp_path, tiny_model_dir):
    result = _cli("validate", _job(tmp_path, tiny_model_dir, output={"keep_columns": ["nope"]}))
    assert result.exit_code == 2
    assert "output.keep_columns names nope, not column(s) of the source; columns: id, topic, level" in result.output


@pytest.mark.parametrize("bad_key,message", [
    ("row-1001", "source.key_column 'id' has the duplicate key 'row-1001' (rows 1001 and 1003)"),
    (None, "source.key_column 'id' is null at row 1003"),
])
def test_validate_scans_every_key_as_run_does(tmp_path, tiny_model_dir, bad_key, message):
    job = _job(tmp_path, tiny_model_dir)
    rows = seed_rows(1500)  # the bad key lies past the 1,000 rows the prompt audit samples
    rows[1003]["id"] = bad_key
    write_jsonl(tmp_path / "rows.jsonl", rows)
    result = _cli("validate", job)
    assert result.exit_code == 2 and message in result.output


def test_validate_and_run_word_a_duplicate_key_alike(tmp_path, tiny_model_dir):
    rows = seed_rows(6)
    rows[3]["id"] = rows[1]["id"]
    job = _job(tmp_path, tiny_model_dir)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    validated, ran = _cli("validate", job), _cli("run", job, "--no-progress")
    assert validated.exit_code == ran.exit_code == 2
    error = validated.output.strip()
    assert "duplicate key 'row-0001' (rows 1 and 3)" in error and error in ran.output


def test_validate_refuses_a_sampling_change_against_an_existing_output_as_run_does(tmp_path, tiny_model_dir):
    job = _job(tmp_path, tiny_model_dir)
    assert _cli("run", job, "--no-progress").exit_code == 0
    same = _cli("validate", job)
    assert same.exit_code == 0 and "holds an earlier run of this job; a run resumes it" in same.output
    changed = _cli("validate", job, "--set", "sampling.temperature=0.5")
    assert changed.exit_code == 2
    refused = _cli("run", job, "--no-progress", "--set", "sampling.temperature=0.5")
    assert refused.exit_code == 2
    assert "sampling.temperature: 0.0 -> 0.5" in changed.output and changed.output in refused.output  # same words
    elsewhere = _cli("validate", job, "--set", "sampling.temperature=0.5", "-o", tmp_path / "other")
    assert elsewhere.exit_code == 0 and "holds no earlier run" in elsewhere.output


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

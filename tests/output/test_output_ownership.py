"""The output folder is batchgen's only where batchgen wrote: `--fresh` deletes nothing else and refuses a folder
shared with the user's files, naming them; the resolved job goes to job.resolved.yaml, never over a user's file;
an output of an earlier batchgen (its resolved job in job.yaml) is still read."""

from __future__ import annotations

import os
import shutil

import pytest
import yaml

from jobutil import cli_here, read_rows, run_cli, seed_rows, write_job, write_jsonl

NUM_ROWS = 6
USER_JOB_HEAD = "# my job: keep these comments\n"


def _project(tmp_path, model_dir, source: str, out: str = "."):
    """A user's folder: the job (with comments), its source, notes; output.dir `out`."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    src = tmp_path / source
    src.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(src, seed_rows(NUM_ROWS))
    job = write_job(tmp_path, model_dir, {"path": source, "key_column": "id"}, output={"dir": out},
                    sampling={"max_new_tokens": 4})
    job.write_text(USER_JOB_HEAD + job.read_text())
    return job


def _tree(folder):
    return sorted(os.path.relpath(os.path.join(r, f), folder) for r, _, fs in os.walk(folder) for f in fs)


def test_fresh_refuses_a_folder_holding_the_users_files_and_names_them(tmp_path, tiny_model_dir):
    job = _project(tmp_path, tiny_model_dir, "inputs/rows.jsonl")
    done = run_cli("run", str(job))
    assert done.returncode == 0, done.stderr
    user_files = {"job.yaml", "inputs/rows.jsonl", "notes/todo.txt"}
    before = {f: (tmp_path / f).read_bytes() for f in user_files}
    result = cli_here("run", str(job), "--fresh")
    assert result.returncode == 2, result.stderr
    assert "--fresh refused" in result.stderr and "inputs/, job.yaml, notes/" in result.stderr
    assert "it holds the job file" in result.stderr and "Traceback" not in result.stderr
    assert {f: (tmp_path / f).read_bytes() for f in user_files} == before
    assert len(read_rows(tmp_path)) == NUM_ROWS  # batchgen's results are untouched too: nothing was deleted


def test_fresh_refusal_names_the_first_entries_and_counts_the_rest(tmp_path):
    from batchgen.output.fresh import refusal
    from batchgen.output.layout import write_marker

    write_marker(tmp_path)  # a batchgen output: its shard is batchgen's
    for i in range(12):
        (tmp_path / f"user-{i:02d}.txt").write_text("x")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "part-w00000-000000.parquet").write_text("batchgen's")
    (tmp_path / "data" / "holiday.jpg").write_text("not batchgen's")
    why = refusal(tmp_path)
    assert "13 entries batchgen did not write: data/holiday.jpg, user-00.txt" in why and "and 5 more" in why
    assert "part-w00000" not in why


def test_a_source_in_the_outputs_data_folder_is_refused_and_fresh_deletes_nothing(tmp_path, tiny_model_dir):
    job = _project(tmp_path, tiny_model_dir, "data/rows.jsonl")  # output.dir: . -- the layout
    before = _tree(tmp_path)
    for command in (("validate",), ("run",), ("run", "--fresh")):  # validate refuses what run refuses
        result = cli_here(command[0], str(job), *command[1:])
        assert result.returncode == 2, result.stderr
        assert "lies in" in result.stderr and "data" in result.stderr and "output folder of its own" in result.stderr
        assert _tree(tmp_path) == before
    assert (tmp_path / "job.yaml").read_text().startswith(USER_JOB_HEAD)


def test_a_run_in_the_jobs_folder_keeps_the_users_job_file_and_writes_job_resolved_yaml(tmp_path, tiny_model_dir):
    job = _project(tmp_path, tiny_model_dir, "inputs/rows.jsonl")
    text = job.read_text()
    result = run_cli("run", str(job))
    assert result.returncode == 0, result.stderr
    assert job.read_text() == text  # comments and all
    assert "also holds the job file" in result.stderr  # a warning, once: the folder is shared
    resolved = tmp_path / "job.resolved.yaml"
    assert resolved.read_text().startswith("# batchgen:")
    assert yaml.safe_load(resolved.read_text())["output"]["dir"] == str(tmp_path)
    assert (tmp_path / ".batchgen").is_file()


def test_a_resolved_job_file_batchgen_did_not_write_is_never_overwritten(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(NUM_ROWS))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"max_new_tokens": 4})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "job.resolved.yaml").write_text("mine: true\n")
    result = cli_here("run", str(job))
    assert result.returncode == 2 and "was not written by batchgen" in result.stderr
    assert (tmp_path / "out" / "job.resolved.yaml").read_text() == "mine: true\n"


@pytest.fixture(scope="module")
def finished_once(tmp_path_factory, tiny_model_dir):
    """A finished job's folder (job file, source, output), run once for the module."""
    tmp = tmp_path_factory.mktemp("finished")
    write_jsonl(tmp / "rows.jsonl", seed_rows(NUM_ROWS))
    job = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"max_new_tokens": 4}, output={"dir": "out", "rows_per_shard": 2})
    result = run_cli("run", str(job))
    assert result.returncode == 0, result.stderr
    return tmp


@pytest.fixture
def finished(finished_once, tmp_path):
    """(job file, output) of a copy of that folder, for one test to change: the job's paths are relative, and
    the resolved job names the copy's output folder, as a run there would have written it."""
    folder = tmp_path / "project"
    shutil.copytree(finished_once, folder)
    resolved = folder / "out" / "job.resolved.yaml"
    resolved.write_text(resolved.read_text().replace(str(finished_once.resolve()), str(folder.resolve())))
    return folder / "job.yaml", folder / "out"


def test_every_file_a_run_writes_is_recognised_as_batchgens(finished):
    from batchgen.output.layout import foreign_entries

    _, out = finished
    assert (out / "README.md").is_file() and (out / "reports" / "index.html").is_file()
    assert foreign_entries(out) == []


def test_fresh_refuses_users_files_named_like_batchgens_inside_its_folders_and_deletes_nothing(finished):
    """Only the exact names batchgen writes are its own: a user's copy or notes beside them that start with a
    worker tag (`part-w00000-000000.parquet.orig`, `w00000-notes.txt`, `w00000.jsonl.bak`) are the user's."""
    from batchgen.output.layout import foreign_entries

    job, out = finished
    user_files = {"data/part-w00000-000000.parquet.orig": (out / "data" / "part-w00000-000000.parquet").read_bytes(),
                  "logs/w00000-my-notes.txt": b"mine", "manifest/w00000.jsonl.bak": b"mine",
                  "reports/w00000.json.old": b"mine", "logs/throughput-w00000.jsonl.1": b"mine"}
    for rel, data in user_files.items():
        (out / rel).write_bytes(data)
    assert foreign_entries(out) == sorted(user_files)
    result = cli_here("run", str(job), "--fresh")
    assert result.returncode == 2 and "--fresh refused" in result.stderr, result.stderr
    assert {rel: (out / rel).read_bytes() for rel in user_files} == user_files
    assert len(read_rows(out)) == NUM_ROWS


def test_a_users_job_yaml_in_a_marked_output_is_never_taken_for_an_earlier_batchgens(finished):
    """A plain dump of a job with this folder as its absolute output.dir reads like an earlier batchgen's resolved
    job; in a folder batchgen marked it is the user's: --fresh refuses, naming it, and keeps it."""
    from batchgen.output.layout import foreign_entries

    job, out = finished
    resolved = yaml.safe_load((out / "job.resolved.yaml").read_text())
    assert resolved["output"]["dir"] == str(out.resolve())
    mine = yaml.safe_dump(resolved).encode()
    (out / "job.yaml").write_bytes(mine)
    assert foreign_entries(out) == ["job.yaml"]
    result = cli_here("run", str(job), "--fresh")
    assert result.returncode == 2 and "--fresh refused" in result.stderr and "job.yaml" in result.stderr
    assert (out / "job.yaml").read_bytes() == mine and len(read_rows(out)) == NUM_ROWS


def test_an_earlier_batchgens_job_yaml_stays_batchgens_once_a_resume_marked_its_output(finished):
    """An output of a batchgen before the marker (its resolved job in job.yaml) resumed by this one gets the marker,
    which records that job.yaml: --fresh still deletes it (it was refused as a user's file); edited, it is the
    user's."""
    from batchgen.output.layout import foreign_entries

    job, out = finished

    def as_an_earlier_batchgen_left_it():
        resolved = (out / "job.resolved.yaml").read_text()
        (out / "job.yaml").write_text(resolved.split("\n", 1)[1])
        (out / "job.resolved.yaml").unlink()
        (out / ".batchgen").unlink()

    as_an_earlier_batchgen_left_it()
    resumed = run_cli("run", str(job))
    assert resumed.returncode == 0 and (out / ".batchgen").exists(), resumed.stderr
    assert foreign_entries(out) == []
    again = run_cli("run", str(job), "--fresh")
    assert again.returncode == 0, again.stderr
    assert not (out / "job.yaml").exists() and len(read_rows(out)) == NUM_ROWS
    as_an_earlier_batchgen_left_it()
    assert run_cli("run", str(job)).returncode == 0
    (out / "job.yaml").write_text((out / "job.yaml").read_text() + "\n")  # changed since: the user's now
    assert foreign_entries(out) == ["job.yaml"]


def test_a_folder_batchgen_never_used_holding_files_under_its_names_is_refused_by_run_and_fresh(tmp_path,
                                                                                                  tiny_model_dir):
    """No .batchgen marker and no earlier output's records: a user's fingerprint.json, numerics.json or
    reports/index.html are the user's. A run refuses to write over them and --fresh to delete them, naming them."""
    from batchgen.output.layout import foreign_entries

    write_jsonl(tmp_path / "rows.jsonl", seed_rows(NUM_ROWS))
    out = tmp_path / "site"
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"max_new_tokens": 4}, output={"dir": "site"})
    user_files = {"fingerprint.json": b'{"my": 1}', "numerics.json": b"keep", "reports/index.html": b"<html>mine",
                  "README.md": b"# my site"}
    for rel, data in user_files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    assert foreign_entries(out) == ["fingerprint.json", "numerics.json", "reports/index.html"]
    for extra in ((), ("--fresh",)):
        result = cli_here("run", str(job), *extra)
        assert result.returncode == 2, result.stderr
        assert "fingerprint.json, numerics.json, reports/index.html" in result.stderr, result.stderr
        assert {rel: (out / rel).read_bytes() for rel in user_files} == user_files
        assert not (out / ".batchgen").exists() and not (out / "data").exists()
    (out / "fingerprint.json").unlink(), (out / "numerics.json").unlink(), (out / "reports" / "index.html").unlink()
    assert run_cli("run", str(job)).returncode == 0  # the user's README.md alone stays and is kept
    assert (out / "README.md").read_bytes() == b"# my site" and len(read_rows(out)) == NUM_ROWS


def test_readers_use_job_resolved_yaml_and_an_earlier_outputs_job_yaml(finished, tmp_path):
    job, out = finished
    assert not (out / "job.yaml").exists()
    status = cli_here("status", str(out))
    assert f"{NUM_ROWS} rows committed of {NUM_ROWS}" in status.stdout, status.stdout + status.stderr
    assert cli_here("export", str(out), "--to", str(tmp_path / "a.jsonl")).returncode == 0
    # an output of an earlier batchgen: no marker, the resolved job (a plain dump) in job.yaml
    resolved = (out / "job.resolved.yaml").read_text()
    (out / "job.yaml").write_text(resolved.split("\n", 1)[1])
    (out / "job.resolved.yaml").unlink()
    (out / ".batchgen").unlink()
    status = cli_here("status", str(out))
    assert f"{NUM_ROWS} rows committed of {NUM_ROWS}" in status.stdout, status.stdout + status.stderr
    assert cli_here("export", str(out), "--to", str(tmp_path / "b.jsonl")).returncode == 0
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    again = run_cli("run", str(job), "--fresh")  # the old job.yaml is batchgen's: --fresh may delete it
    assert again.returncode == 0, again.stderr
    assert not (out / "job.yaml").exists() and (out / "job.resolved.yaml").exists()
    assert len(read_rows(out)) == NUM_ROWS


def test_fresh_is_refused_while_another_worker_of_the_output_is_running_and_names_it(finished):
    from batchgen.output.lock import WorkerLock

    job, out = finished
    running = WorkerLock(out, "w00001", count=2)
    try:
        result = run_cli("run", str(job), "--fresh")
    finally:
        running.release()
    assert result.returncode == 2, result.stderr
    assert f"worker 1 of 2 (pid {os.getpid()}) is running" in result.stderr and "nothing was deleted" in result.stderr
    assert len(read_rows(out)) == NUM_ROWS


def test_a_finished_run_leaves_no_lock_file_and_files_others_can_read(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"})
    assert run_cli("run", str(job)).returncode == 0
    out = tmp_path / "out"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".lock-")]
    assert (out / "fingerprint.json").stat().st_mode & 0o044 == (out / "job.resolved.yaml").stat().st_mode & 0o044
    text = (out / "fingerprint.json").read_text()
    assert text.startswith('{\n  "fingerprint": ') and '\n    "model": {\n' in text  # indented, one key a line

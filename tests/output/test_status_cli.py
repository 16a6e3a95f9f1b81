"""`batchgen status` reads a worker's rate from its throughput log, says running/stopped from its lock, shows
progress before the first commit, gives an ETA only while a worker runs, accepts a job file, and says what a
folder without output holds. Output folders are written by hand here: status only reads the disk."""

from __future__ import annotations

import json
import os
import time

import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.output.lock import WorkerLock, is_held
from jobutil import seed_rows, write_jsonl

runner = CliRunner()
NUM_ROWS = 40


@pytest.fixture
def out(tmp_path):
    """An output folder of a 40-row job: job.yaml (so status knows the row count), no commits yet."""
    source = write_jsonl(tmp_path / "rows.jsonl", seed_rows(NUM_ROWS))
    out = tmp_path / "out"
    out.mkdir()
    (out / "job.yaml").write_text(yaml.safe_dump({"source": {"path": str(source), "key_column": "id"}}))
    return out


def _commit(out, tag, num_rows, at):
    (out / "manifest").mkdir(exist_ok=True)
    record = {"commit": 0, "data": None, "rejects": None, "num_rows": num_rows, "num_samples": num_rows,
              "num_rejects": 0, "num_prompt_tokens": 10, "num_completion_tokens": 5 * num_rows, "time": at,
              "keys": []}
    with open(out / "manifest" / f"{tag}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _log(out, tag, *, rows_done, rows_committed, elapsed_s, at):
    (out / "logs").mkdir(exist_ok=True)
    record = {"time": at, "elapsed_s": elapsed_s, "rows_done": rows_done, "rows_committed": rows_committed}
    with open(out / "logs" / f"throughput-{tag}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _status(target):
    return runner.invoke(app, ["status", str(target)])


def test_rate_comes_from_the_throughput_log_not_the_time_between_first_and_last_commit(out):
    now = time.time()
    _commit(out, "w00000", 10, now - 101)
    _commit(out, "w00000", 10, now - 100)  # two commits 1 s apart: 20 rows/s by the old reckoning
    _log(out, "w00000", rows_done=20, rows_committed=20, elapsed_s=100.0, at=now - 100)
    result = _status(out)
    assert result.exit_code == 0, result.output
    assert "20 rows committed of 40 (50.0%)" in result.output
    assert "0.20 rows/s" in result.output and "20.00 rows/s" not in result.output


def test_after_a_kill_the_worker_is_stopped_and_there_is_no_eta(out):
    now = time.time()
    WorkerLock(out, "w00000").release()  # the lock file a killed run leaves, held by nobody
    _commit(out, "w00000", 10, now)
    _log(out, "w00000", rows_done=10, rows_committed=10, elapsed_s=50.0, at=now)
    result = _status(out)
    assert result.exit_code == 0, result.output
    assert "w00000: stopped" in result.output and "ended without a report" in result.output
    assert "ETA" not in result.output and "rate" not in result.output
    assert "no worker is running: 30 rows remain" in result.output


def test_a_signalled_run_is_stopped_with_its_report_status(out):
    WorkerLock(out, "w00000").release()
    _commit(out, "w00000", 10, time.time())
    (out / "reports").mkdir()
    (out / "reports" / "w00000.json").write_text(json.dumps({"status": "interrupted", "time": time.time()}))
    result = _status(out)
    assert "w00000: stopped" in result.output
    assert "its last run ended" in result.output and "ago (interrupted)" in result.output
    assert "ETA" not in result.output


def test_a_running_worker_shows_progress_and_an_eta_before_its_first_commit(out):
    lock = WorkerLock(out, "w00001")
    try:
        assert is_held(lock.path)
        result = _status(out)  # started, nothing logged yet: it is there, running
        assert result.exit_code == 0, result.output
        assert "w00001: running" in result.output and "no row finished yet in this run" in result.output
        _log(out, "w00001", rows_done=4, rows_committed=0, elapsed_s=20.0, at=time.time())
        result = _status(out)
        assert "0 rows committed of 40 (0.0%) (+4 finished, not committed yet)" in result.output
        assert "w00001: running" in result.output and "0.20 rows/s" in result.output
        assert "no commit yet in this run" in result.output
        assert "1 of 1 workers running; rate 0.20 rows/s; ETA 3.0 min" in result.output  # 36 rows at 0.2/s
    finally:
        lock.release()
    assert not is_held(lock.path)
    assert "w00001: stopped" in _status(out).output


def test_a_status_probe_does_not_make_a_starting_run_fail(out):
    import fcntl
    import threading

    fd = os.open(out / ".lock-w00000", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a probe, held far longer than a real one
    threading.Timer(0.1, os.close, [fd]).start()
    WorkerLock(out, "w00000").release()  # waits the probe out instead of calling it another run


def test_status_of_a_job_file_reads_its_output_directory(tmp_path, out):
    job = tmp_path / "demo.yaml"
    job.write_text(yaml.safe_dump({"model": {"path": "m"}, "source": {"path": "rows.jsonl"},
                                   "prompt": {"column": "topic"}, "output": {"dir": "out"}}))
    _commit(out, "w00000", 40, time.time())
    result = _status(job)
    assert result.exit_code == 0, result.output
    assert f"{out}: 40 rows committed of 40 (100.0%)" in result.output and "complete" in result.output
    (tmp_path / "other.yaml").write_text(job.read_text().replace("dir: out", "dir: elsewhere"))
    result = _status(tmp_path / "other.yaml")
    assert result.exit_code == 2 and f"{tmp_path / 'elsewhere'} does not exist" in result.output


def test_a_folder_with_only_a_lock_file_says_what_is_there(tmp_path):
    folder = tmp_path / "failed"
    folder.mkdir()
    WorkerLock(folder, "w00000").release()
    result = _status(folder)
    assert result.exit_code == 0, result.output
    assert "w00000: stopped" in result.output
    assert "nothing was committed here; it holds: .lock-w00000" in result.output
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    result = _status(tmp_path / "notes")
    assert result.exit_code == 2
    assert "holds no batchgen output" in result.output and "it holds: todo.txt" in result.output


def test_a_file_under_a_lock_name_that_no_run_wrote_is_no_worker(out):
    _commit(out, "w00000", 40, time.time())
    (out / ".lock-w00007").write_text("not a lock\n")  # copied in, or a user's
    (out / ".lock-w00008").write_text("")
    WorkerLock(out, "w00003").release()  # a killed run's: a stopped worker
    result = _status(out)
    assert result.exit_code == 0, result.output
    assert "w00007" not in result.output and "w00008" not in result.output
    assert "w00003: stopped" in result.output and "40 rows committed of 40" in result.output


def test_a_running_worker_that_committed_before_its_first_throughput_record_is_not_said_to_have_no_row(out):
    lock = WorkerLock(out, "w00001")
    try:
        _commit(out, "w00001", 4, time.time() + 1)  # a commit of this run, before the log's first ~5 s record
        result = _status(out)
        assert "w00001: running" in result.output and "committing in this run" in result.output, result.output
        assert "no row finished yet" not in result.output
    finally:
        lock.release()

"""One partition at a time: workers running at once on an output deal the rows alike (same worker count and unit
size), or the later one is refused (exit 2) naming both; with nobody running, a resume may use any count. And the
local launcher's workers import the installed batchgen whatever the current folder holds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobutil import cli_here, REPO, read_rows, run_cli, seed_rows, write_job, write_jsonl

NUM_ROWS = 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("partition")
    write_jsonl(tmp / "rows.jsonl", seed_rows(NUM_ROWS))
    job = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"max_new_tokens": 6}, engine={"max_num_seqs": 2}, output={"rows_per_shard": 2})
    return tmp, job


def _keys(out):
    keys = [(r["id"], r["sample_idx"]) for r in read_rows(out)]
    assert len(keys) == len(set(keys)), "a row was written twice"
    return sorted(keys)


def test_a_worker_of_another_count_is_refused_while_one_runs_naming_both(setup):
    from batchgen.output.lock import WorkerLock

    tmp, job = setup
    out = tmp / "held"
    out.mkdir()
    running = WorkerLock(out, "w00001", count=2)  # worker 1 of 2, alive (this process)
    try:
        result = run_cli("run", str(job), "-o", str(out), "--worker-index", "0", "--num-workers", "1")
    finally:
        running.release()
    assert result.returncode == 2, result.stderr
    assert f"worker 0 of 1 cannot start in {out}: worker 1 of 2 (pid {os.getpid()}) is running" in result.stderr
    assert "2 workers, not 1" in result.stderr and "Traceback" not in result.stderr
    assert not (out / "data").exists()  # refused before anything was read or written


def test_a_worker_dealing_another_unit_size_is_refused_while_one_runs(setup):
    from batchgen.output.lock import WorkerLock

    tmp, job = setup
    out = tmp / "units"
    out.mkdir()
    running = WorkerLock(out, "w00001", count=2)
    running.record_partition(2, 3)  # worker 1 of 2 dealing units of 3 rows; this job's units are sized 20
    try:
        result = run_cli("run", str(job), "-o", str(out), "--worker-index", "0", "--num-workers", "2")
    finally:
        running.release()
    assert result.returncode == 2, result.stderr
    assert "rows dealt in units of 3, not 20" in result.stderr
    assert not list((out / "data").glob("*.parquet"))


# a worker held mid-run: after HELD_AFTER_STEPS engine steps (past its first commit: 2 rows of 6 tokens, 2 at a
# time), each step waits while the gate file exists; the test removes it once it has started the other worker
SLOW_WORKER = """
import os, sys, time
from batchgen.engine.engine import Engine
step, gate, held_after = Engine.step, sys.argv[1], int(sys.argv[2])
num_steps = [0]
def held_step(self, *a, **k):
    num_steps[0] += 1
    while num_steps[0] > held_after and os.path.exists(gate):
        time.sleep(0.02)
    return step(self, *a, **k)
Engine.step = held_step
sys.argv = ["batchgen", *sys.argv[3:]]
from batchgen.cli import main
main()
"""
HELD_AFTER_STEPS = 12


def _start_held(job, out, gate, index, count):
    gate.touch()
    return subprocess.Popen([sys.executable, "-c", SLOW_WORKER, str(gate), str(HELD_AFTER_STEPS), "run", str(job),
                             "-o", str(out), "--no-progress", "--worker-index", str(index), "--num-workers", str(count)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_workers_of_two_counts_at_once_never_duplicate_rows_and_a_resume_completes(setup):
    """Worker 1 of 2 running, worker 0 of 1 started: refused (before, both ran: 60 rows committed of 40)."""
    tmp, job = setup
    out, gate = tmp / "two-counts", tmp / "two-counts.hold"
    first = _start_held(job, out, gate, 1, 2)
    manifest = out / "manifest" / "w00001.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (manifest.exists() and manifest.read_text().count("\n") >= 1):
        assert first.poll() is None, first.communicate()
        time.sleep(0.02)
    second = run_cli("run", str(job), "-o", str(out), "--worker-index", "0", "--num-workers", "1")
    assert first.poll() is None, "worker 1 of 2 is held until the gate goes: it must still be running"
    gate.unlink()
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert second.returncode == 2 and "worker 1 of 2" in second.stderr and "2 workers, not 1" in second.stderr
    assert len(_keys(out)) == NUM_ROWS // 2
    resumed = run_cli("run", str(job), "-o", str(out))  # nobody running: another count is fine
    assert resumed.returncode == 0, resumed.stderr
    assert f"{NUM_ROWS // 2} already done" in resumed.stdout
    assert _keys(out) == sorted((r["id"], 0) for r in seed_rows(NUM_ROWS))
    status = cli_here("status", str(out))
    assert f"{NUM_ROWS} rows committed of {NUM_ROWS} (100.0%)" in status.stdout, status.stdout


def test_a_lock_left_by_a_stopped_worker_of_another_count_does_not_block_a_resume(setup):
    from batchgen.output.lock import WorkerLock

    tmp, job = setup
    out = tmp / "stale"
    out.mkdir()
    WorkerLock(out, "w00002", count=3).release()  # a killed worker 2 of 3: its file, held by nobody
    result = run_cli("run", str(job), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert len(_keys(out)) == NUM_ROWS


def test_launched_workers_import_the_installed_batchgen_whatever_the_current_folder(setup):
    tmp, job = setup
    cwd = tmp / "a-checkout"
    (cwd / "batchgen").mkdir(parents=True)
    (cwd / "batchgen" / "__init__.py").write_text("")  # a folder named batchgen, not the package
    out = tmp / "launched"
    script = Path(sys.executable).with_name("batchgen")  # the console script: cwd is not on its sys.path
    result = subprocess.run([str(script), "run", str(job), "-o", str(out), "--workers", "2", "--no-progress"],
                            cwd=cwd, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert "all 2 workers done" in result.stderr
    assert len(_keys(out)) == NUM_ROWS

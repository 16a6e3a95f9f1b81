"""Several worker processes on one output directory: their union equals a single-worker run, row for row,
also after one of them is killed and the job is resumed with a different number of workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from jobutil import cli_here, content_once, REPO, read_rows, run_cli, run_here, seed_rows, write_job, write_jsonl

NUM_ROWS = 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("workers")
    write_jsonl(tmp / "rows.jsonl", seed_rows(NUM_ROWS))
    job = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id", "worker_unit_rows": 3},
                    sampling={"temperature": 0.8, "max_new_tokens": 10}, engine={"max_num_seqs": 2},
                    output={"rows_per_shard": 2})
    single = tmp / "single"
    assert run_cli("run", str(job), "-o", str(single)).returncode == 0
    return tmp, job, content_once(single)


def _start(job, out, index, count):
    return subprocess.Popen([sys.executable, "-m", "batchgen.cli", "run", str(job), "-o", str(out), "--no-progress",
                             "--worker-index", str(index), "--num-workers", str(count)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_three_concurrent_workers_equal_one_worker(setup):
    tmp, job, reference = setup
    out = tmp / "three"
    procs = [_start(job, out, i, 3) for i in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert content_once(out) == reference
    assert {f.name for f in (out / "manifest").iterdir()} == {"w00000.jsonl", "w00001.jsonl", "w00002.jsonl"}
    status = run_cli("status", str(out))
    assert f"{NUM_ROWS} rows committed of {NUM_ROWS}" in status.stdout and "w00002:" in status.stdout


def test_kill_one_of_three_then_resume_with_two_workers_is_exact(setup):
    tmp, job, reference = setup
    out = tmp / "killed"
    procs = [_start(job, out, i, 3) for i in range(3)]
    manifest = out / "manifest" / "w00001.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (manifest.exists() and manifest.read_text().count("\n") >= 1):
        time.sleep(0.01)
    procs[1].send_signal(signal.SIGKILL)
    for p in procs:
        p.communicate(timeout=300)
    assert procs[1].returncode == -signal.SIGKILL
    assert len(read_rows(out)) < len(reference)
    resumed = [_start(job, out, i, 2) for i in range(2)]
    for p in resumed:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert content_once(out) == reference


def test_local_launcher_runs_n_workers_and_equals_one_worker(setup):
    tmp, job, reference = setup
    out = tmp / "launched"
    result = run_cli("run", str(job), "-o", str(out), "--workers", "3")
    assert result.returncode == 0, result.stderr
    assert "all 3 workers done" in result.stderr
    assert content_once(out) == reference
    # the dataset card is written once, after every worker, and counts every worker's rows
    card = (out / "README.md").read_text()
    assert f"{len(reference):,} rows in" in card


def test_fresh_with_several_workers_is_refused(setup):
    tmp, job, _ = setup
    result = cli_here("run", str(job), "-o", str(tmp / "x"), "--fresh", "--worker-index", "0", "--num-workers", "2")
    assert result.returncode == 2 and "--fresh with several workers" in result.stderr
    assert not (tmp / "x").exists()


def test_a_failing_worker_makes_the_launcher_exit_non_zero_after_the_others_commit(setup):
    tmp, job, reference = setup
    out = tmp / "launched-failing"
    result = run_cli("run", str(job), "-o", str(out), "--workers", "3",
                     env={"BATCHGEN_FAULT": "engine_step:2", "BATCHGEN_FAULT_WORKER": "1"})
    assert result.returncode == 1, result.stderr
    assert "worker 1 exited 1" in result.stderr and "injected engine failure" in result.stderr
    manifests = {f.stem: f.read_text().count("\n") for f in (out / "manifest").iterdir()}
    unit_rows = 3  # source.worker_unit_rows of this job: workers 0 and 2 finished their parts
    done = {r["id"] for r in read_rows(out)}
    for w in (0, 2):
        mine = {f"row-{p:04d}" for p in range(NUM_ROWS) if (p // unit_rows) % 3 == w}
        assert mine <= done, f"worker {w} did not finish ({manifests})"
    run_here(job, out)  # the launcher's exit path is what this test is about; one worker resumes it
    assert content_once(out) == reference


@pytest.mark.parametrize("resume_workers", [1, 3])
def test_a_worker_killed_in_its_first_commit_leaves_no_row_twice_after_a_resume_with_another_count(setup,
                                                                                                  resume_workers):
    """Worker 1 dies between renaming its first shard into place and writing its first record (it has no
    manifest yet): a resume with one worker (worker 0 owns the tags beyond its count) or three (worker 1 owns
    its own) deletes that leftover shard, and every row is in the output once."""
    tmp, job, reference = setup
    out = tmp / f"first-commit-killed-{resume_workers}"
    killed = run_cli("run", str(job), "-o", str(out), "--workers", "2",
                     env={"BATCHGEN_FAULT": "shard_renamed:1", "BATCHGEN_FAULT_WORKER": "1"})
    assert killed.returncode != 0, killed.stderr
    assert (out / "data" / "part-w00001-000000.parquet").exists() and not (out / "manifest" / "w00001.jsonl").exists()
    args = ("--workers", str(resume_workers)) if resume_workers > 1 else ()
    resumed = run_cli("run", str(job), "-o", str(out), *args)
    assert resumed.returncode == 0, resumed.stderr
    assert content_once(out) == reference
    assert run_cli("verify", str(out)).returncode == 0
    assert "uncommitted" not in run_cli("verify", str(out)).stdout


def test_the_launcher_exits_with_a_workers_own_code_else_128_plus_the_signal_that_stopped_one():
    """A worker killed by SIGTERM before its handler ran (-15 from Popen) makes the launcher exit 143, as a lone
    `batchgen run` stopped by it does, not 1 (a fault where running again helps)."""
    import signal

    from batchgen.job.launcher import exit_code

    assert exit_code([0, 0]) == 0
    assert exit_code([-signal.SIGTERM, -signal.SIGTERM]) == 143
    assert exit_code([0, -signal.SIGKILL]) == 137
    assert exit_code([-signal.SIGTERM, 143]) == 143  # a worker's own code first
    assert exit_code([-signal.SIGTERM, 1, 2]) == 1


def test_a_key_repeated_in_two_workers_rows_stops_every_worker_before_any_row_is_generated(tmp_path,
                                                                                           tiny_model_dir):
    """Each worker sees only its own rows, so without the up-front scan both halves of a duplicate were generated
    and committed and the output read as damaged ('rows committed twice'). Now: exit 2 naming the key and both
    rows, nothing written; the same source in one worker stops when it reaches the duplicate."""
    rows = seed_rows(8)
    rows[6]["id"] = rows[1]["id"]  # rows 0-3 go to worker 0, rows 4-7 to worker 1 (units of 4)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id", "worker_unit_rows": 4},
                    sampling={"max_new_tokens": 4})
    for args in (("--workers", "2"), ("--worker-index", "1", "--num-workers", "2")):
        result = run_cli("run", str(job), "-o", str(tmp_path / "out"), "--no-progress", *args)
        assert result.returncode == 2, result.stderr
        assert "duplicate key 'row-0001' (rows 1 and 6)" in result.stderr
        assert not list((tmp_path / "out").rglob("*.parquet"))

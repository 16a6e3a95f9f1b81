"""Exactly once under kill -9 and signals: crash a real `batchgen run` process at every stage of the
commit protocol, rerun until done, and compare with an uninterrupted run row for row."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from jobutil import REPO, read_rows, run_cli, run_here, seed_rows, write_job, write_jsonl

NUM_ROWS = 23


def _key(r):
    return (r["id"], r["sample_idx"])


def _content(rows):
    """Rows without num_cached_tokens: prefix-cache hits depend on what else ran, not on the output."""
    return sorted(({k: v for k, v in r.items() if k != "num_cached_tokens"} for r in rows), key=_key)


def _rows(out):
    return _content(read_rows(out))


def _assert_exactly_once_and_equal(out, reference):
    got = read_rows(out)
    keys = [_key(r) for r in got]
    assert len(keys) == len(set(keys)), "a row was written twice"
    assert _content(got) == reference


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("crash")
    write_jsonl(tmp / "rows.jsonl", seed_rows(NUM_ROWS))
    seeded = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"}, name="seeded.yaml",
                       sampling={"temperature": 0.9, "n": 2, "max_new_tokens": 10},
                       engine={"max_num_seqs": 4})
    greedy = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"}, name="greedy.yaml",
                       sampling={"temperature": 0.0, "max_new_tokens": 10}, engine={"max_num_seqs": 4})
    refs = {}
    for job in (seeded, greedy):
        out = tmp / f"ref-{job.stem}"
        run_here(job, out)
        refs[job.stem] = _rows(out)
    assert len(refs["seeded"]) == 2 * NUM_ROWS and len(refs["greedy"]) == NUM_ROWS
    return tmp, {"seeded": seeded, "greedy": greedy}, refs


@pytest.mark.parametrize("job_name,fault", [
    ("seeded", "commit_start:1"),  # before the first commit
    ("seeded", "commit_done:2"),  # between commits
    ("seeded", "shard_renamed:3"),  # during a commit: shard visible, not yet in the manifest
    ("seeded", "manifest_torn:2"),  # during a commit: half a manifest line on disk
    ("greedy", "shard_renamed:2"),
])
def test_kill_9_at_any_commit_stage_then_resume_is_exactly_once(workspace, job_name, fault):
    tmp, jobs, refs = workspace
    out = tmp / f"out-{job_name}-{fault.replace(':', '-')}"
    crashed = run_cli("run", str(jobs[job_name]), "-o", str(out), env={"BATCHGEN_FAULT": fault})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    partial = read_rows(out)
    assert len(partial) < len(refs[job_name])
    run_here(jobs[job_name], out)  # the next run: in this process (the killed one's leftovers are what counts)
    _assert_exactly_once_and_equal(out, refs[job_name])


def test_kill_9_of_a_running_job_at_a_random_moment_then_resume(workspace):
    tmp, jobs, refs = workspace
    out = tmp / "out-live-kill"
    proc = subprocess.Popen([sys.executable, "-m", "batchgen.cli", "run", str(jobs["seeded"]), "-o", str(out),
                             "--no-progress", "--set", "output.rows_per_shard=2"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    manifest = out / "manifest" / "w00000.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if manifest.exists() and manifest.read_text().count("\n") >= 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = run_cli("run", str(jobs["seeded"]), "-o", str(out), "--set", "output.rows_per_shard=2")
    assert resumed.returncode == 0, resumed.stderr
    _assert_exactly_once_and_equal(out, refs["seeded"])


def test_sigterm_commits_finished_rows_exits_quickly_and_resume_completes(workspace):
    tmp, jobs, refs = workspace
    out = tmp / "out-sigterm"
    proc = subprocess.Popen([sys.executable, "-m", "batchgen.cli", "run", str(jobs["seeded"]), "-o", str(out),
                             "--no-progress", "--set", "output.rows_per_shard=2", "--set", "engine.max_num_seqs=1"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    manifest = out / "manifest" / "w00000.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (manifest.exists() and manifest.read_text().count("\n") >= 1):
        time.sleep(0.01)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    if proc.returncode != 0:  # it may have finished before the signal landed
        assert proc.returncode == 128 + signal.SIGTERM, stderr
        assert "Run the same command again to resume" in stderr
    assert run_cli("run", str(jobs["seeded"]), "-o", str(out)).returncode == 0
    _assert_exactly_once_and_equal(out, refs["seeded"])

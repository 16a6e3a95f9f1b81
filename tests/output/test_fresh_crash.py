"""A crash (kill -9) at any step of `--fresh` leaves a state the next run understands: no row is ever counted as
done while its shard is gone (the manifest leaves before the data), and the next run, plain or `--fresh`,
finishes the interrupted fresh and ends with every row exactly once, equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from jobutil import cli_here, REPO, read_rows, run_cli, run_here, seed_rows, write_job, write_jsonl

NUM_ROWS = 9

# Kills a fresh start after `k` filesystem steps (output/fresh.py's _step: each mkdir, rename, unlink, rmdir).
# Run as `python -c KILL_AT k -- <batchgen args>` (the whole CLI) or `python -c KILL_AT k OUT` (the fresh alone,
# under the locks the CLI takes): exit 137 when killed; printed "steps N" when the fresh finished in N steps.
KILL_AT = """
import os, sys
from pathlib import Path
import batchgen.output.fresh as fresh
k, taken, real = int(sys.argv[1]), [0], fresh._step
def step(op, *args):
    if taken[0] == k:
        os._exit(137)
    taken[0] += 1
    real(op, *args)
fresh._step = step
if sys.argv[2] == "--":
    sys.argv = ["batchgen", *sys.argv[3:]]
    from batchgen.cli import main
    try:
        main()
    finally:
        print("steps", taken[0])
else:
    from batchgen.output.lock import AllWorkersLock, DirectoryLock
    out = Path(sys.argv[2])
    with DirectoryLock(out), AllWorkersLock(out):
        fresh.start_over(out)
    print("steps", taken[0])
"""


def _kill_at(k: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILL_AT, str(k), *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)


def _content(out):
    rows = read_rows(out)
    keys = [(r["id"], r["sample_idx"]) for r in rows]
    assert len(keys) == len(set(keys)), "a row is in the output twice"
    return sorted((r["id"], r["sample_idx"], r["completion"]) for r in rows)


def _records(out):
    records = []
    for path in sorted((out / "manifest").glob("w*.jsonl")) if (out / "manifest").is_dir() else []:
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


@pytest.fixture(scope="module")
def done(tmp_path_factory, tiny_model_dir):
    """A finished output (data, a manifest of several commits, logs, reports, card) and its rows."""
    tmp = tmp_path_factory.mktemp("fresh-crash")
    write_jsonl(tmp / "rows.jsonl", seed_rows(NUM_ROWS))
    job = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"max_new_tokens": 4, "temperature": 0.8}, output={"rows_per_shard": 2})
    out = tmp / "done"
    run_here(job, out)
    assert len(_records(out)) >= 5
    return tmp, job, out, _content(out)


def test_a_kill_at_each_step_of_fresh_never_leaves_a_done_row_without_its_shard(done):
    from batchgen.output.fresh import finish_interrupted

    tmp, _, finished, _ = done
    counted = _kill_at(10**6, str(shutil.copytree(finished, tmp / "count")))
    assert counted.returncode == 0, counted.stderr
    num_steps = int(counted.stdout.split()[-1])
    assert num_steps >= 20  # mkdir, a rename per entry, then an unlink per file
    for k in range(num_steps):
        out = shutil.copytree(finished, tmp / f"killed-{k}")
        assert _kill_at(k, str(out)).returncode == 137
        for record in _records(out):  # what any reader would count as done is still there, whole
            assert (out / record["data"]).is_file(), (k, record["data"])
        finish_interrupted(out)  # what the next run does first, under the directory lock
        left = sorted(os.listdir(out))
        if k == 0:  # killed before its first step: the output stands, untouched
            # (a finished run leaves no lock file; the killed --fresh left the ones it held)
            assert [e for e in left if not e.startswith(".lock-")] == sorted(os.listdir(finished))
            assert _content(out) == _content(finished)
        else:
            assert left == [".batchgen", ".lock-dir"], (k, left)  # the marker, and the killed process's lock


@pytest.mark.parametrize("step,next_run,pending", [
    (1, "plain", True),  # the pending folder made, nothing moved yet
    (2, "plain", True),  # the manifest moved out, every shard still in data/
    (3, "--fresh", True),  # data/ moved out too
    (14, "plain", False),  # everything moved out and renamed for deletion, part of it deleted
])
def test_after_a_kill_inside_fresh_the_next_run_ends_with_every_row_exactly_once(done, step, next_run, pending):
    tmp, job, finished, reference = done
    out = shutil.copytree(finished, tmp / f"cli-{step}-{next_run}")
    killed = _kill_at(step, "--", "run", str(job), "-o", str(out), "--fresh", "--no-progress")
    assert killed.returncode == 137, killed.stderr
    if pending:  # the readers say what to do instead of reporting shards without records as damage
        for command in ("status", "verify", "repair"):
            told = cli_here(command, str(out))  # readers: in this process
            assert told.returncode == 2 and "--fresh` of" in told.stderr and "was interrupted" in told.stderr, told
    again = run_cli("run", str(job), "-o", str(out), *(["--fresh"] if next_run == "--fresh" else []))
    assert again.returncode == 0, again.stderr
    assert ("interrupted; finishing it" in again.stderr) == pending
    assert not [p for p in os.listdir(out) if p.startswith(".batchgen-")]  # the old output's last files deleted
    assert f"{NUM_ROWS} rows committed" in again.stdout  # regenerated, none reported as already done
    assert _content(out) == reference
    named = {r["data"] for r in _records(out)}
    assert {f"data/{f.name}" for f in (out / "data").iterdir()} == named  # no orphan shard left behind

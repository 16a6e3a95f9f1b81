"""`batchgen run --ray`: units dealt to Ray worker actors as they free up give the same rows as one plain worker,
exactly once, also when an actor is killed mid-run, when the driver is killed and the job is run again with
another worker count, and with a slow worker (which gets fewer rows). The driver-kill test runs the CLI in its
own process with its own local Ray; the others run the driver here, on one local Ray instance for the module
(starting Ray costs ~10 s on a 2-core machine)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from batchgen.output.lock import running_workers
from batchgen.output.manifest import checked_ledger
from jobutil import content_once, REPO, run_cli, run_here, seed_rows, write_job, write_jsonl

pytest.importorskip("ray")

NUM_ROWS = 48
SLOW = {"BATCHGEN_FAULT_SLOW": "engine_step:0.02"}  # every worker: a run long enough to be killed mid-way


def _rows_by_worker(out) -> dict[str, int]:
    """Input rows each worker committed, from the checked manifests."""
    counts: dict[str, int] = {}
    for entry in checked_ledger(out).entries:
        counts[entry.tag] = counts.get(entry.tag, 0) + entry.record["num_rows"]
    return counts


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("ray")
    write_jsonl(tmp / "rows.jsonl", seed_rows(NUM_ROWS))
    job = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id", "worker_unit_rows": 3},
                    sampling={"temperature": 0.8, "max_new_tokens": 10, "n": 2}, engine={"max_num_seqs": 2},
                    output={"rows_per_shard": 2})
    single = tmp / "single"
    assert run_cli("run", str(job), "-o", str(single)).returncode == 0
    return tmp, job, content_once(single)


@pytest.fixture(scope="module")
def ray_here():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def _run_here(job, out, monkeypatch, workers: int, env: dict | None = None, during=None, overrides=()):
    """The driver in this process (on the module's Ray), `during` in a thread meanwhile."""
    from batchgen.job.job_file import load_spec
    from batchgen.ray.driver import run_on_ray

    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)  # the driver forwards BATCHGEN_* to its actors
    side = threading.Thread(target=during, daemon=True) if during else None
    if side:
        side.start()
    result = run_on_ray(load_spec(job, list(overrides), str(out)), workers=workers, show_progress=False)
    if side:
        side.join(timeout=300)
    return result


def _start(job, out, *extra, env=None):
    return subprocess.Popen([sys.executable, "-m", "batchgen.cli", "run", str(job), "-o", str(out), "--no-progress",
                             "--ray", *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def _wait_for_commits(out, tag: str, num_lines: int, proc=None, timeout_s: float = 300) -> None:
    """Until worker `tag` has `num_lines` records (a wait, not a timing claim: CI runs Ray tests side by side on 2
    cores, where a driver started in a subprocess took over 120 s to its third commit)."""
    path = out / "manifest" / f"{tag}.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= num_lines:
            return
        assert proc is None or proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {num_lines} records")


def test_three_ray_workers_equal_one_plain_worker_row_for_row(setup, ray_here, monkeypatch):
    tmp, job, reference = setup
    out = tmp / "three"
    result = _run_here(job, out, monkeypatch, 3, env=SLOW)  # slowed: all three take part before the job ends
    assert content_once(out) == reference
    assert result.rows_committed == NUM_ROWS and result.interrupted_by is None
    assert sorted(result.report["workers"]) == [0, 1, 2]
    assert set(_rows_by_worker(out)) == {"w00000", "w00001", "w00002"}
    assert not list(out.glob(".lock-*")), "a finished Ray job leaves no lock file"
    assert (out / "README.md").exists() and (out / "reports" / "w00002.json").exists()


def test_a_killed_ray_worker_is_replaced_and_the_job_ends_exactly_once(setup, ray_here, monkeypatch, capfd):
    tmp, job, reference = setup
    out = tmp / "killed"
    killed = []

    def kill_worker_1():
        _wait_for_commits(out, "w00001", 2)
        pid = json.loads((out / ".lock-w00001").read_text())["pid"]  # the actor's process
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    result = _run_here(job, out, monkeypatch, 3, env=SLOW, during=kill_worker_1)
    assert killed and "Ray worker 1 failed" in capfd.readouterr().err
    assert result.interrupted_by is None
    assert content_once(out) == reference


def test_a_killed_driver_resumes_with_two_workers_exactly_once(setup):
    tmp, job, reference = setup
    out = tmp / "driver"
    proc = _start(job, out, "--workers", "3", env=SLOW)
    _wait_for_commits(out, "w00000", 3, proc)
    proc.kill()  # SIGKILL: no chance to commit; Ray ends the actors it owned
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 60
    while running_workers(out):  # the actors outlive their driver by a moment (and may commit meanwhile)
        assert time.monotonic() < deadline, running_workers(out)
        time.sleep(0.2)
    committed = sum(_rows_by_worker(out).values())
    assert 0 < committed < NUM_ROWS
    done = run_cli("run", str(job), "-o", str(out), "--ray", "--workers", "2")
    assert done.returncode == 0, done.stderr
    assert f"{committed} already done" in done.stdout
    assert content_once(out) == reference


def test_a_slow_ray_worker_gets_fewer_units_than_a_fast_one(setup, ray_here, monkeypatch):
    tmp, job, _ = setup
    out = tmp / "slow"
    _run_here(job, out, monkeypatch, 2, env={"BATCHGEN_FAULT_SLOW": "engine_step:0.2", "BATCHGEN_FAULT_WORKER": "1"})
    rows = _rows_by_worker(out)
    assert rows["w00000"] + rows["w00001"] == NUM_ROWS
    assert rows["w00001"] * 2 < rows["w00000"], rows


@pytest.mark.parametrize("extra, env, message", [
    (["--worker-index", "0", "--num-workers", "2"], {}, "--ray deals the rows itself: drop --worker-index"),
    (["--gpus", "all"], {}, "drop --worker-index/--num-workers/--gpus"),
    ([], {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "4"}, "worker 1 of 4 by its Slurm array variables"),
    (["--workers", "two"], {}, "--workers takes a number, not 'two'"),
])
def test_ray_refuses_a_static_worker_identity_with_a_clear_message(setup, extra, env, message):
    tmp, job, _ = setup
    done = run_cli("run", str(job), "-o", str(tmp / "refused"), "--ray", *extra, env=env)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp / "refused").exists()


def test_a_ray_resume_whose_settings_changed_is_refused_before_ray_starts(setup):
    """The fingerprint's refusal, as every worker of a plain run makes it, said by the driver before it starts Ray
    (the actors made it only after Ray's start and their own, 10-30 s later); nothing in the output changes."""
    tmp, job, _ = setup
    out = tmp / "changed"
    run_here(job, out, ("source.limit=4",))  # a plain run, here
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    done = run_cli("run", str(job), "-o", str(out), "--ray", "--set", "source.limit=4", "--set",
                   "sampling.max_new_tokens=7")
    assert done.returncode == 2 and "refusing to resume" in done.stderr and "max_new_tokens" in done.stderr, \
        done.stderr
    assert "batchgen: Ray:" not in done.stderr, done.stderr  # the line the driver prints once Ray is up
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_sigterm_to_the_driver_commits_what_is_finished_and_a_rerun_completes_it(setup, ray_here, monkeypatch):
    tmp, job, reference = setup
    out = tmp / "sigterm"

    def terminate_driver():
        _wait_for_commits(out, "w00000", 2)
        os.kill(os.getpid(), signal.SIGTERM)  # the driver's handler runs in this process's main thread

    stopped = _run_here(job, out, monkeypatch, 2, env=SLOW, during=terminate_driver)
    assert stopped.interrupted_by == signal.SIGTERM and 0 < stopped.rows_committed < NUM_ROWS
    assert not running_workers(out) and not list(out.glob(".lock-*"))
    monkeypatch.delenv("BATCHGEN_FAULT_SLOW")
    resumed = _run_here(job, out, monkeypatch, 2)
    assert resumed.rows_skipped == stopped.rows_committed and resumed.interrupted_by is None
    assert content_once(out) == reference


def _rank_pids(rank_class: str = "RayRank") -> list[int]:
    """The processes of this Ray's tensor-parallel follower actors (Ray names a process after its actor)."""
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"]) if any(rank_class in part for part in p.info["cmdline"]
                                                                     or [])]


def test_tensor_parallel_ray_workers_survive_a_lost_rank_and_write_the_single_rank_rows_once(
        setup, tiny_model_dir, ray_here, monkeypatch, capfd):
    """engine.tensor_parallel_size 2 on CPU (gloo): a worker of 2 ranks in one placement group; its rank 1 is
    SIGKILLed mid-run, the whole group is replaced and its unfinished units dealt again."""
    from batchgen.job.job_file import load_spec
    from batchgen.job.run import run_job

    tmp = setup[0]
    job = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id", "worker_unit_rows": 3},
                    name="tp.yaml", sampling={"temperature": 0.0, "max_new_tokens": 10},
                    engine={"max_num_seqs": 3}, output={"rows_per_shard": 2})
    run_job(load_spec(job, [], str(tmp / "tp-single")), show_progress=False)  # the reference: one rank
    out = tmp / "tp-ray"
    killed = []

    def kill_a_rank():
        _wait_for_commits(out, "w00000", 2, timeout_s=300)  # four processes set up on a 2-core machine: slow
        pids = _rank_pids()
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        killed.append(pids[0])

    result = _run_here(job, out, monkeypatch, 1, env=SLOW, during=kill_a_rank,
                       overrides=["engine.tensor_parallel_size=2"])
    err = capfd.readouterr().err
    assert killed and "failed" in err, err[-3000:]
    assert "Ray: 1 worker (2 ranks of 1 CPU each)" in err and "Ray worker 0 failed" in err
    assert result.interrupted_by is None
    deadline = time.monotonic() + 30  # a killed actor's process exits a moment after ray.kill returns
    while _rank_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _rank_pids(), "every rank ended with the job"
    assert content_once(out) == content_once(tmp / "tp-single")


def _reserve_cpus(num_cpus: int):
    """A placement group holding `num_cpus` of the module's Ray CPUs (a cluster busy with other work)."""
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group([{"CPU": num_cpus}])
    ray.get(group.ready(), timeout=60)
    return group


def test_a_worker_the_cluster_cannot_place_is_named_and_let_go_once_the_others_finish(setup, ray_here, monkeypatch,
                                                                                      capfd):
    from ray.util.placement_group import remove_placement_group

    from batchgen.ray import driver

    tmp, job, reference = setup
    out = tmp / "unplaced"
    monkeypatch.setattr(driver, "PLACE_WARN_S", 0.5)
    busy = _reserve_cpus(3)  # room for one of the two workers
    try:
        result = _run_here(job, out, monkeypatch, 2)
    finally:
        remove_placement_group(busy)
    err = capfd.readouterr().err
    # (what is free is read a moment after the placed worker took its CPU: Ray's count may lag)
    assert re.search(r"waits for the cluster to place it \(1 CPU\); the cluster has [01] of 4 CPUs free", err), \
        err[-2000:]
    assert result.rows_committed == NUM_ROWS and len(_rows_by_worker(out)) == 1
    assert content_once(out) == reference


def test_a_job_no_worker_of_which_can_be_placed_stops_with_what_the_cluster_has(setup, ray_here, monkeypatch):
    from ray.util.placement_group import remove_placement_group

    from batchgen.errors import JobError
    from batchgen.ray import driver

    tmp, job, _ = setup
    monkeypatch.setattr(driver, "PLACE_TIMEOUT_S", 2.0)
    busy = _reserve_cpus(4)
    try:
        with pytest.raises(JobError, match="no Ray worker could be placed in 2 s: each asks for 1 CPU, and the "
                                           "cluster has 0 of 4 CPUs free"):
            _run_here(job, tmp / "nowhere", monkeypatch, 1)
    finally:
        remove_placement_group(busy)
    assert checked_ledger(tmp / "nowhere").entries == []


def test_a_stop_while_a_worker_waits_to_be_placed_commits_and_returns_interrupted(setup, ray_here, monkeypatch):
    """SIGTERM to the driver with one worker never placed: the placed one commits what is finished, the other
    is let go (it holds no unit), and the run returns as interrupted instead of waiting for a placement."""
    from ray.util.placement_group import remove_placement_group

    tmp, job, reference = setup
    out = tmp / "stop-unplaced"

    def terminate_driver():
        _wait_for_commits(out, "w00000", 2)
        os.kill(os.getpid(), signal.SIGTERM)

    busy = _reserve_cpus(3)
    try:
        stopped = _run_here(job, out, monkeypatch, 2, env=SLOW, during=terminate_driver)
    finally:
        remove_placement_group(busy)
    assert stopped.interrupted_by == signal.SIGTERM and 0 < stopped.rows_committed < NUM_ROWS
    assert set(_rows_by_worker(out)) == {"w00000"}


def test_a_duplicate_key_stops_a_ray_job_before_any_worker_starts(setup, ray_here, monkeypatch, tmp_path):
    """Actors see only the units they are dealt: the driver scans every key first (job/run.py
    check_keys_before_any_row), so a repeated key is a JobError naming both rows and nothing is written."""
    from batchgen.errors import JobError

    _, job, _ = setup
    rows = seed_rows(8)
    rows[7]["id"] = rows[0]["id"]
    write_jsonl(tmp_path / "dup.jsonl", rows)
    with pytest.raises(JobError, match=r"duplicate key 'row-0000' \(rows 0 and 7\)"):
        _run_here(job, tmp_path / "out", monkeypatch, workers=2, overrides=[f"source.path={tmp_path / 'dup.jsonl'}"])
    assert not list((tmp_path / "out").rglob("*.parquet"))


def test_a_killed_workers_unrecorded_shard_never_stays_beside_the_rows_others_committed(setup, ray_here, monkeypatch,
                                                                                        tmp_path):
    """Worker 0 killed after renaming a shard into data/ and before recording it, at every second commit (each
    replacement too): its rows are dealt again, and at the end data/ holds only recorded shards, whether or not a
    replacement started to delete its predecessor's leftover (one that never started left it, beside the same rows
    committed by worker 1: load_dataset("OUT") read them twice)."""
    tmp, job, reference = setup
    out = tmp_path / "out"
    _run_here(job, out, monkeypatch, 2, env={"BATCHGEN_FAULT": "shard_renamed:2", "BATCHGEN_FAULT_WORKER": "0"})
    recorded = {e.record["data"] for e in checked_ledger(out).entries if e.record.get("data")}
    assert {f"data/{p.name}" for p in (out / "data").glob("*.parquet")} == recorded
    assert content_once(out) == reference


def test_tidying_at_the_end_removes_only_leftovers_of_workers_no_process_holds(setup, tmp_path):
    import shutil

    from batchgen.output.lock import WorkerLock
    from batchgen.ray.output_dir import tidy_leftovers

    tmp, job, _ = setup
    out = tmp_path / "out"
    assert run_cli("run", str(job), "-o", str(out)).returncode == 0
    shard = sorted((out / "data").glob("*.parquet"))[0]
    for tag in ("w00001", "w00002"):  # no records: a shard renamed in a first commit, killed before recording it
        shutil.copy(shard, out / "data" / f"part-{tag}-000000.parquet")
    (out / "data" / "notes.parquet").write_bytes(b"the user's")
    running = WorkerLock(out, "w00002")
    try:
        assert tidy_leftovers(out) == ["data/part-w00001-000000.parquet"]
    finally:
        running.remove()
    assert (out / "data" / "part-w00002-000000.parquet").exists() and (out / "data" / "notes.parquet").exists()


def test_a_source_column_the_job_names_and_lacks_stops_a_ray_job_before_the_output_is_made(setup, ray_here,
                                                                                          monkeypatch, tmp_path):
    """As a plain run refuses it before writing: the driver checks the source's columns before it prepares the
    output (the first actor refused it after: marker, locks and resolved job stayed, read as killed workers)."""
    from batchgen.errors import JobError

    _, job, _ = setup
    with pytest.raises(JobError, match="source.sampling_column 'params' is not a column of the source"):
        _run_here(job, tmp_path / "out", monkeypatch, workers=2, overrides=["source.sampling_column=params"])
    assert not (tmp_path / "out").exists()

"""`--ray --workers auto` on a cluster that grows while the job runs: the driver starts workers on the new node
and they take part; every row is still written exactly once. A simulated two-node cluster on this machine
(ray.cluster_utils.Cluster)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from jobutil import REPO, read_rows, seed_rows, write_job, write_jsonl

pytest.importorskip("ray")

NUM_ROWS = 30


def test_workers_auto_starts_workers_on_a_node_that_joins_while_the_job_runs(tmp_path, tiny_model_dir):
    from ray.cluster_utils import Cluster

    write_jsonl(tmp_path / "rows.jsonl", seed_rows(NUM_ROWS))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id", "worker_unit_rows": 2},
                    engine={"max_num_seqs": 2}, output={"rows_per_shard": 2, "report": False})
    out = tmp_path / "out"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        driver = subprocess.Popen(
            [sys.executable, "-m", "batchgen.cli", "run", str(job), "-o", str(out), "--no-progress", "--ray",
             "--workers", "auto"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": cluster.address,
                 "BATCHGEN_FAULT_SLOW": "engine_step:0.1"})  # the job outlasts the new node's start
        deadline = time.monotonic() + 120
        while not (out / "manifest" / "w00000.jsonl").exists():
            assert time.monotonic() < deadline and driver.poll() is None, driver.communicate()
            time.sleep(0.1)
        cluster.add_node(num_cpus=2)
        stdout, stderr = driver.communicate(timeout=300)
    finally:
        cluster.shutdown()
    assert driver.returncode == 0, stderr
    assert "the Ray cluster grew: worker 2 started" in stderr and "(Ray, 3 workers)" in stdout
    keys = [r["id"] for r in read_rows(out)]
    assert sorted(keys) == sorted(r["id"] for r in seed_rows(NUM_ROWS))

"""Faults during a run: disk full, an engine exception, repeated signals, out of memory at start-up, KV cache
exhaustion. Each checks the message and that committed rows are neither lost nor duplicated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import REPO, read_rows, run_cli, run_here, seed_rows, write_job, write_jsonl

NUM_ROWS = 14


def _content(out):
    rows = read_rows(out)
    keys = [(r["id"], r["sample_idx"]) for r in rows]
    assert len(keys) == len(set(keys)), "a row was written twice"
    return sorted(({k: v for k, v in r.items() if k != "num_cached_tokens"} for r in rows), key=lambda r: r["id"])


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("faults")
    write_jsonl(tmp / "rows.jsonl", seed_rows(NUM_ROWS))
    job = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"temperature": 0.7, "max_new_tokens": 12}, engine={"max_num_seqs": 3},
                    output={"rows_per_shard": 3})
    ref = tmp / "reference"
    run_here(job, ref)
    return tmp, job, _content(ref)


def test_disk_full_while_writing_a_shard_records_nothing_and_the_next_run_resumes(setup):
    tmp, job, reference = setup
    out = tmp / "diskfull"
    failed = run_cli("run", str(job), "-o", str(out), env={"BATCHGEN_FAULT": "shard_write:2"})
    assert failed.returncode == 1
    assert f"cannot write shard in {out / 'data'}" in failed.stderr and "No space left" in failed.stderr
    records = (out / "manifest" / "w00000.jsonl").read_text().splitlines()
    assert len(records) == 1  # the first commit only; the failed shard was never recorded
    assert not list((out / "data").glob(".*.tmp"))
    assert len(read_rows(out)) == 3
    run_here(job, out)  # the next run, in this process
    assert _content(out) == reference


def test_engine_exception_mid_run_exits_non_zero_and_the_next_run_finishes(setup):
    tmp, job, reference = setup
    out = tmp / "enginefail"
    failed = run_cli("run", str(job), "-o", str(out), env={"BATCHGEN_FAULT": "engine_step:30"})
    assert failed.returncode == 1
    assert "the run failed: RuntimeError: injected engine failure" in failed.stderr
    assert "Traceback" not in failed.stderr
    partial = read_rows(out)
    assert 0 < len(partial) < NUM_ROWS  # finished rows were committed, in-flight ones were not
    run_here(job, out)  # the next run, in this process
    assert _content(out) == reference


def test_second_signal_exits_at_once_without_corrupting_the_output(setup):
    tmp, job, reference = setup
    out = tmp / "twosignals"
    proc = subprocess.Popen([sys.executable, "-m", "batchgen.cli", "run", str(job), "-o", str(out), "--no-progress",
                             "--set", "engine.max_num_seqs=1", "--set", "output.rows_per_shard=1"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    manifest = out / "manifest" / "w00000.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (manifest.exists() and manifest.read_text().count("\n") >= 1):
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    if proc.returncode != 0:
        assert proc.returncode == 128 + signal.SIGINT, stderr
    run_here(job, out)  # the next run, in this process
    assert _content(out) == reference


def test_out_of_memory_at_start_up_names_the_knobs(setup, monkeypatch):
    tmp, job, _ = setup
    from batchgen.engine import engine as engine_module

    def no_memory(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(engine_module.Engine, "__init__", no_memory)
    result = CliRunner().invoke(app, ["run", str(job), "-o", str(tmp / "oom"), "--no-progress"])
    assert result.exit_code == 2
    assert "out of memory while setting up the engine" in result.output
    assert "engine.num_kv_blocks" in result.output and "engine.cpu_kv_cache_bytes" in result.output  # CPU knobs


def test_a_kv_cache_larger_than_memory_on_cpu_exits_2_naming_the_knobs_before_allocating(setup, monkeypatch):
    """The engine's own check (a cache over the memory available, within the machine's total: job/preflight.py
    refuses one over the total from the config, tested in test_validate_matches_run_and_workers_get_rows.py)."""
    import os

    real_sysconf = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 1 << 40 if name == "SC_PHYS_PAGES" else real_sysconf(name))
    tmp, job, _ = setup
    result = CliRunner().invoke(app, ["run", str(job), "-o", str(tmp / "huge"), "--no-progress",
                                      "--set", "engine.num_kv_blocks=50000000"])
    assert result.exit_code == 2, result.output
    assert "the KV cache needs" in result.output and "GiB of memory is available" in result.output
    assert "engine.num_kv_blocks (now 50000000)" in result.output and "run the same command" not in result.output


def test_kv_cache_exhaustion_preempts_and_every_row_matches_a_large_cache_run(setup, tiny_model_dir):
    tmp, _, _ = setup
    write_jsonl(tmp / "long.jsonl", [{"id": f"r{i}", "topic": "the sea " * (3 + i % 5), "level": i} for i in range(12)])
    job = write_job(tmp, tiny_model_dir, {"path": "long.jsonl", "key_column": "id"}, name="kv.yaml",
                    sampling={"temperature": 0.0, "max_new_tokens": 30}, engine={"max_num_seqs": 8})
    big = tmp / "kv-big"
    small = tmp / "kv-small"
    run_here(job, big)
    run_here(job, small, ("engine.num_kv_blocks=16", "engine.block_size=8"))
    report = json.loads((small / "reports" / "w00000.json").read_text())
    assert report["engine"]["num_preemptions"] > 0
    assert _content(small) == _content(big)

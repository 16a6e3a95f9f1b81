"""A fault of one row while it is generated (its grammar, its tokenizer output, an error in its own bookkeeping)
rejects that row with its class and message; the other rows are written and the job exits 0. Only a fault that
hits every row (the engine's own) stops the job, and then no row is recorded as rejected for it.

Faults are injected into one request of a running `batchgen run` (a separate process) by a wrapper that
patches the engine before the CLI starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from batchgen.job.loop import MAX_CONSECUTIVE_ENGINE_ERRORS

from jobutil import REPO, read_rows, seed_rows, write_job, write_jsonl

NUM_ROWS = 12

# Patched into the run: request REQUEST's sample 0 fails when its AT-th token is appended (or when its text is
# made, for KIND detokenize); REQUEST "*" fails every request.
INJECT = """
import sys
from batchgen.engine import engine as engine_mod, request as request_mod
kind, target, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
def hit(req):
    return target == "*" or req.request_id == target + "#0"
if kind == "detokenize":
    final_text = engine_mod.final_text
    calls = []
    def patched_text(tokenizer, ids, *a, **k):
        calls.append(1)
        if len(calls) == at:
            raise ValueError("injected tokenizer failure")
        return final_text(tokenizer, ids, *a, **k)
    engine_mod.final_text = patched_text
else:
    append = request_mod.Request.append_token
    def patched_append(self, token_id):
        if hit(self) and len(self.output_token_ids) + 1 == at:
            if kind == "grammar":
                raise request_mod.RequestFault("grammar_error", "injected grammar dead end")
            raise IndexError("injected bookkeeping failure")
        return append(self, token_id)
    request_mod.Request.append_token = patched_append
sys.argv = ["batchgen", *sys.argv[4:]]
from batchgen.cli import main
main()
"""


def _run(kind: str, target: str, at: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", INJECT, kind, target, str(at), *args, "--no-progress"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("rowfaults")
    write_jsonl(tmp / "rows.jsonl", seed_rows(NUM_ROWS))
    return write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                     sampling={"temperature": 0.8, "max_new_tokens": 10, "n": 2}, engine={"max_num_seqs": 4},
                     output={"rows_per_shard": 4})


def _rejects(out):
    return read_rows(out, "rejects")


@pytest.mark.parametrize("kind, error_class", [("grammar", "grammar_error"), ("bookkeeping", "engine_error"),
                                               ("detokenize", "detokenize_error")])
def test_one_rows_fault_rejects_that_row_and_the_job_exits_0(job, kind, error_class):
    out = job.parent / f"out-{kind}"
    done = _run(kind, "req-5", 3, "run", str(job), "-o", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rejects = _rejects(out)
    assert len(rejects) == 1 and rejects[0]["error_class"] == error_class, rejects
    assert "injected" in rejects[0]["message"]
    rows = read_rows(out)
    keys = {r["id"] for r in rows}
    assert len(rows) == 2 * (NUM_ROWS - 1) and len(keys) == NUM_ROWS - 1  # both samples of every other row
    assert rejects[0]["id"] not in keys
    report = json.loads((out / "reports" / "w00000.json").read_text())
    assert report["rejects_by_class"] == {error_class: 1} and report["rows_rejected"] == 1


def test_a_fault_in_every_row_stops_the_job_records_none_and_a_clean_rerun_finishes_exactly_once(job):
    out = job.parent / "out-every-row"
    num_rows = MAX_CONSECUTIVE_ENGINE_ERRORS + 4
    write_jsonl(job.parent / "many.jsonl", seed_rows(num_rows))
    job = write_job(job.parent, str(yaml.safe_load(job.read_text())["model"]["path"]),
                    {"path": "many.jsonl", "key_column": "id"}, name="many.yaml",
                    sampling={"temperature": 0.8, "max_new_tokens": 4, "n": 2}, engine={"max_num_seqs": 8})
    failed = _run("bookkeeping", "*", 2, "run", str(job), "-o", str(out))
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert "in a row" in failed.stderr and "Traceback" not in failed.stderr
    assert _rejects(out) == [] and read_rows(out) == []
    rerun = subprocess.run([sys.executable, "-m", "batchgen.cli", "run", str(job), "-o", str(out), "--no-progress"],
                           capture_output=True, text=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    rows = read_rows(out)
    assert sorted((r["id"], r["sample_idx"]) for r in rows) == sorted(
        (f"row-{i:04d}", s) for i in range(num_rows) for s in range(2))

"""The job bench's A/B of `batchgen run` options (`bench --workload job --ab-run '...'`): B runs the same job with
those options, A without, in the order A B B A, and the option is refused where it cannot apply."""

import subprocess
import sys
from pathlib import Path

from batchgen.bench import job, job_run


def test_an_ab_run_gives_b_the_run_options_and_a_none():
    variants = job._variants(None, ["sampling.logprobs=5"], [], ["--ray", "--workers", "1"])
    assert variants == [("A", None, ["sampling.logprobs=5"], []),
                        ("B", None, ["sampling.logprobs=5"], ["--ray", "--workers", "1"])]
    assert job._variants("/other/checkout", [], [])[1] == ("B", None, [], [])  # --compare: same options both sides


def test_a_run_with_options_passes_them_to_batchgen_run_after_the_sets(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: seen.append(cmd))
    job_run._run_process(tmp_path / "job.yaml", tmp_path / "out", 256, 1.0, None, ["a.b=1"], ["--ray", "--workers", "1"])
    cmd = seen[0]
    assert cmd[:4] == [sys.executable, "-m", "batchgen.cli", "run"]
    assert cmd[-5:] == ["--set", "a.b=1", "--ray", "--workers", "1"]
    assert "engine.max_num_seqs=256" in cmd


def test_bench_refuses_ab_run_outside_the_job_workload_and_beside_another_ab():
    def bench(*args):
        return subprocess.run([sys.executable, "-m", "batchgen.cli", "bench", *args], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[2])

    r = bench("--workload", "seed", "--ab-run", "--ray --workers 1")
    assert r.returncode == 2 and "--ab-run applies to --workload job only" in r.stderr
    r = bench("--workload", "job", "--ab-run", "--ray", "--ab-set", "engine.max_num_seqs=512")
    assert r.returncode == 2 and "give one" in r.stderr

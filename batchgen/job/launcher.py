"""`batchgen run --workers N` / `--gpus N|all`: start one worker process per GPU (or N CPU workers) on this
machine, forward signals to them, and wait. Each worker is an ordinary `batchgen run --worker-index i
--num-workers N`, so what it writes is exactly what a Slurm array would write. A worker that fails makes
the command exit non-zero, after the others have finished and committed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from batchgen.errors import JobError
from batchgen.job.run import write_report_or_say_why
from batchgen.job.spec import load_spec

# Scheduler variables a child must not see: its identity comes from the flags we give it.
_IDENTITY_VARS = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX",
                  "RANK", "WORLD_SIZE", "LOCAL_RANK", "JOB_COMPLETION_INDEX", "BATCHGEN_NUM_WORKERS")


def resolve_gpus(gpus: str) -> list[int]:
    import torch

    available = torch.cuda.device_count()
    if available == 0:
        raise JobError("--gpus: no CUDA GPU is visible on this machine; use --workers N for CPU worker processes")
    if gpus == "all":
        return list(range(available))
    try:
        n = int(gpus)
    except ValueError:
        raise JobError(f"--gpus takes a number or 'all', got {gpus!r}") from None
    if not 1 <= n <= available:
        raise JobError(f"--gpus {n}: this machine has {available} visible GPU(s)")
    return list(range(n))


def launch(job: Path, overrides: list[str], output: str | None, num_workers: int, gpus: list[int] | None) -> int:
    procs: list[subprocess.Popen] = []
    for i in range(num_workers):
        env = {k: v for k, v in os.environ.items() if k not in _IDENTITY_VARS}
        env["BATCHGEN_WORKER_INDEX"] = str(i)  # informational (logs, user hooks, fault tests)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpus[i])
        cmd = [sys.executable, "-m", "batchgen.cli", "run", str(job), "--worker-index", str(i),
               "--num-workers", str(num_workers), "--no-progress"]
        for o in overrides:
            cmd += ["--set", o]
        cmd += ["--set", "output.report=false"]  # the card and plots are written once, below, after all workers
        if output is not None:
            cmd += ["--output", output]
        procs.append(subprocess.Popen(cmd, env=env))

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    failed = [(i, c) for i, c in enumerate(codes) if c != 0]
    if failed:
        described = ", ".join(f"worker {i} exited {c}" for i, c in failed)
        print(f"batchgen: {described}; the other workers committed their rows. Run the same command again to "
              f"resume.", file=sys.stderr)
        return next(c for _, c in failed if c > 0) if any(c > 0 for _, c in failed) else 1
    print(f"batchgen: all {num_workers} workers done", file=sys.stderr)
    spec = load_spec(job, overrides, output)
    if spec.output.report:
        write_report_or_say_why(Path(spec.output.dir))
    return 0

"""`batchgen run --workers N` / `--gpus N|all`: start one worker process per GPU (or N CPU workers) on this
machine, forward signals to them, and wait. Each worker is an ordinary `batchgen run --worker-index i
--num-workers N`, so what it writes is exactly what a Slurm array would write. A worker that fails makes
the command exit non-zero, after the others have finished and committed.

With engine.tensor_parallel_size T > 1 each worker is T rank processes (job/ranks.py) on T GPUs (`--gpus 4` with
T = 2: two workers of two GPUs each), rendezvousing on their own free localhost port; signals go to rank 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from batchgen.errors import JobError
from batchgen.job.run import write_report_or_say_why
from batchgen.job.job_file import load_spec

# A worker is started as `python -c CHILD_MAIN`, not `python -m batchgen.cli`: -m (and -c) put the current folder
# first on sys.path, so a `batchgen/` folder there (a checkout, a job's own folder named so) would be imported
# instead. CHILD_MAIN drops that entry and, unless it is on sys.path already (site-packages: the order of the
# others is kept), puts the folder this process imported batchgen from in its place, so every child runs the
# same package as the launcher, whatever the current folder.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
CHILD_MAIN = ("import sys; root = sys.argv.pop(1); sys.path[0:1] = [] if root in sys.path[1:] else [root]; "
              "sys.argv[0] = 'batchgen'; from batchgen.cli import main; main()")

# Scheduler variables a child must not see: its identity comes from the flags we give it.
_IDENTITY_VARS = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX",
                  "SLURM_ARRAY_TASK_STEP", "RANK", "WORLD_SIZE", "LOCAL_RANK", "JOB_COMPLETION_INDEX",
                  "BATCHGEN_NUM_WORKERS")


# how long a worker's other ranks may outlive its rank 0 (they exit at its STOP, normally at once), and how long
# rank 0 may outlive a failed rank (its step's collective then fails, or waits for the NCCL timeout) before a kill
RANK_GRACE_S = 30.0
TERM_DELAY_S = 2.0  # how long rank 0 may take to exit on its own after another rank of its group failed


def _free_port() -> int:
    """A localhost TCP port free now (a group's rendezvous; another process may take it first: rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_groups(groups: list[list[subprocess.Popen]]) -> list[int]:
    """Wait for every worker's ranks, all watched at once; a worker's exit code is its rank 0's, else its first
    failed rank's. A rank left running RANK_GRACE_S after its rank 0 ended well is killed, and at once after it
    failed (it may have failed while the ranks built their engines, when it cannot tell them to stop:
    distributed/plan.py); after another rank of its group failed, rank 0 gets SIGTERM (commit what is finished)
    and the same grace."""
    kill_at: dict[int, float] = {}  # group -> when its ranks still running are killed
    stopped: set[int] = set()  # groups whose rank 0 the launcher signalled after another rank failed
    term_at: dict[int, float] = {}  # group -> when its rank 0, still running after another rank failed, gets SIGTERM
    while any(p.poll() is None for group in groups for p in group):
        for g, group in enumerate(groups):
            leader, others = group[0], group[1:]
            if g not in kill_at and (leader.poll() is not None or any(p.poll() not in (None, 0) for p in others)):
                failed_leader = leader.poll() is not None and leader.returncode != 0
                kill_at[g] = time.monotonic() + (0.0 if failed_leader else RANK_GRACE_S)
                # a rank 0 that failed first may still be exiting when the others fail at its closed group:
                # a moment lets its own exit code (and message) stand
                term_at[g] = time.monotonic() + TERM_DELAY_S
            if g in term_at:
                if leader.poll() is not None:
                    del term_at[g]
                elif time.monotonic() >= term_at[g]:
                    del term_at[g]
                    leader.send_signal(signal.SIGTERM)
                    stopped.add(g)
            if g in kill_at and time.monotonic() >= kill_at[g]:
                for p in group:
                    if p.poll() is None:
                        p.kill()
                        if p is leader:
                            stopped.add(g)
        time.sleep(0.1)
    codes = [[p.wait() for p in group] for group in groups]
    # a group's code: its rank 0's, else its first failed rank's; where the launcher itself stopped rank 0 after
    # another rank failed, that rank's code (rank 0's 143 or -9 would read as an outside stop)
    first_failed = [next((x for x in c[1:] if x != 0), 0) for c in codes]
    return [c[0] if c[0] != 0 and g not in stopped else first_failed[g] or c[0] for g, c in enumerate(codes)]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code(codes: list[int]) -> int:
    """The launcher's exit code from its workers' return codes (0 ok; N > 0 a worker's own exit; -N killed by
    signal N before its handler ran, e.g. a SIGTERM while it was starting): a worker's own failing code first,
    else 128 + N for a signal, as the shell reports it and as a lone `batchgen run` stopped by it exits."""
    own = [c for c in codes if c > 0]
    if own:
        return own[0]
    signals = [-c for c in codes if c < 0]
    return 128 + signals[0] if signals else 0


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


def launch(job: Path, overrides: list[str], output: str | None, num_workers: int, gpus: list[int] | None,
           tensor_parallel_size: int = 1, show_progress: bool = False) -> int:
    """Start the workers (each a group of `tensor_parallel_size` rank processes; `gpus`: every rank's GPU,
    worker after worker) and wait for them. Signals go to each worker's rank 0 only (job/ranks.py)."""
    size = tensor_parallel_size
    groups: list[list[subprocess.Popen]] = []
    for i in range(num_workers):
        env = {k: v for k, v in os.environ.items() if k not in _IDENTITY_VARS and not k.startswith("BATCHGEN_TP_")}
        env["BATCHGEN_WORKER_INDEX"] = str(i)  # informational (logs, user hooks, fault tests)
        if gpus is not None:  # the group's GPUs; rank r takes cuda:r of them
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus[i * size:(i + 1) * size])
        cmd = [sys.executable, "-c", CHILD_MAIN, PACKAGE_ROOT, "run", str(job), "--worker-index", str(i),
               "--num-workers", str(num_workers)]
        for o in overrides:
            cmd += ["--set", o]
        cmd += ["--set", "output.report=false"]  # the card and plots are written once, below, after all workers
        if output is not None:
            cmd += ["--output", output]
        init = f"tcp://127.0.0.1:{_free_port()}"  # each group is its own world
        group = []
        for rank in range(size):
            rank_env = env if size == 1 else {**env, "BATCHGEN_TP_RANK": str(rank), "BATCHGEN_TP_SIZE": str(size),
                                              "BATCHGEN_TP_INIT": init}
            quiet = [] if show_progress and num_workers == 1 and rank == 0 else ["--no-progress"]
            group.append(subprocess.Popen(cmd + quiet, env=rank_env))
        groups.append(group)

    def forward(signum, frame):
        for group in groups:
            if group[0].poll() is None:
                group[0].send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = _wait_groups(groups)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    failed = [(i, c) for i, c in enumerate(codes) if c != 0]
    if failed:
        described = ", ".join(f"worker {i} " + (f"exited {c}" if c > 0 else f"was stopped by {_signal_name(-c)}")
                              for i, c in failed)
        others = ("the other workers committed their rows" if len(failed) < len(codes)
                  else "the rows they committed are kept")
        then = ("Fix what they said, then run the same command again." if all(c == 2 for _, c in failed)
                else "Run the same command again to resume.")  # 2: the job's own error, said by the worker
        print(f"batchgen: {described}; {others}. {then}", file=sys.stderr)
        return exit_code(codes)
    done = f"all {num_workers} workers done" if num_workers > 1 else "the worker is done"
    print(f"batchgen: {done}", file=sys.stderr)
    spec = load_spec(job, overrides, output)
    if spec.output.report:
        write_report_or_say_why(Path(spec.output.dir))
    return 0

"""run_group: one tensor-parallel group of local processes running the same function (tests, the Python API).

    def work(tp, prompts):
        engine = Engine(load_my_model(), tokenizer, EngineConfig(tensor_parallel_size=2), tensor_parallel=tp)
        if not tp.is_leader:  # serve rank 0's steps until it closes its engine
            follow(engine.runner, tp.plans); engine.close(); return None
        with engine:
            return engine.generate(prompts)

    results = run_group(work, 2, prompts)[0]

Processes are spawned (fresh interpreters: `fn` and its arguments must be importable by name and picklable),
on a free localhost port. Robust by construction, never a hang: every wait has a deadline, a rank that fails
ends the others, and whatever is left at the end is killed.
"""

from __future__ import annotations

import contextlib
import queue as queue_mod
import signal
import socket
import sys
import threading
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on localhost now (another process may take it before it is bound: rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, size: int, init_method: str, device_type: str, args: tuple, results) -> None:
    from batchgen.distributed import groups

    try:
        identity = groups.RankIdentity(rank, size, rank, size, rank, init_method, "spawn")
        tp = groups.init_tensor_parallel(identity, device_type)
        results.put((rank, True, fn(tp, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        groups.destroy()


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM (`timeout`, a scheduler's stop) raises SystemExit in the main thread while the group runs, so the
    cleanup below kills the ranks instead of leaving them running, each holding its GPU's memory."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_group(fn, size: int, *args, device_type: str = "cpu", timeout_s: float = 300.0) -> list:
    """fn(group, *args) on ranks 0..size-1, each in its own process; their return values in rank order.
    RuntimeError with the failing rank's traceback, TimeoutError past `timeout_s` (every process killed; also on
    SIGTERM)."""
    with _sigterm_raises():
        return _run_group(fn, size, args, device_type, timeout_s)


def _run_group(fn, size: int, args: tuple, device_type: str, timeout_s: float) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_entry, args=(fn, r, size, init_method, device_type, args, results), daemon=True)
             for r in range(size)]
    deadline = time.monotonic() + timeout_s
    values: dict[int, object] = {}
    try:
        for p in procs:  # inside the try: a SIGTERM between two starts still kills the first
            p.start()
        while len(values) < size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"tensor-parallel group of {size}: ranks {sorted(set(range(size)) - set(values))} "
                                   f"did not finish within {timeout_s:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"tensor-parallel rank {dead[0]} exited with {procs[dead[0]].exitcode} "
                                       f"before returning") from None
                continue
            if not ok:
                raise RuntimeError(f"tensor-parallel rank {rank} failed:\n{value}")
            values[rank] = value
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return [values[r] for r in range(size)]

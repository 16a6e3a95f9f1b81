"""Fault injection for the crash tests: BATCHGEN_FAULT=POINT:N acts the Nth time POINT is reached.
Kill points (SIGKILL): commit_start, shard_renamed, manifest_torn, commit_done.
Raise points: shard_write (OSError ENOSPC while writing a shard), engine_step (RuntimeError in the loop),
engine_build (MemoryError building the engine, after a tensor-parallel job's other ranks started theirs).
BATCHGEN_FAULT_WORKER=I limits it to the worker the launcher started with BATCHGEN_WORKER_INDEX=I.
BATCHGEN_FAULT_SLOW=POINT:SECONDS sleeps that long every time POINT is reached (a slow worker: engine_step).

Unset (always, outside tests) each check is one environment lookup (~0.1 us): the commit points run once per
commit, `engine_step` once per engine step. The per-point counters below exist only in a process whose
BATCHGEN_FAULT is set."""

from __future__ import annotations

import os
import signal
import time

_hits: dict[str, int] = {}  # per-process counter; only consulted when BATCHGEN_FAULT is set


def _this_worker() -> bool:
    only = os.environ.get("BATCHGEN_FAULT_WORKER")  # with --workers/--gpus/--ray: only this worker index fails
    return only is None or only == os.environ.get("BATCHGEN_WORKER_INDEX")


def armed(point: str) -> bool:
    """True when this is the Nth arrival at `point` named by BATCHGEN_FAULT."""
    spec = os.environ.get("BATCHGEN_FAULT")
    if not spec:
        return False
    name, _, nth = spec.partition(":")
    if name != point:
        return False
    if not _this_worker():
        return False
    _hits[point] = _hits.get(point, 0) + 1
    return _hits[point] == int(nth or 1)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crash_if_armed(point: str) -> None:
    if armed(point):
        die()


def raise_if_armed(point: str, error: BaseException) -> None:
    if armed(point):
        raise error


def slow_if_armed(point: str) -> None:
    spec = os.environ.get("BATCHGEN_FAULT_SLOW")
    if not spec:
        return
    name, _, seconds = spec.partition(":")
    if name == point and _this_worker():
        time.sleep(float(seconds))

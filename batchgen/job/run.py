"""The job runner, composition root: source -> prompts -> engine -> shard writer, with resume and signals.

Exactly once: rows whose keys a manifest records are skipped; every other row of this worker's part is
generated and committed once. A signal stops admission, commits what is finished and returns; whatever
was in flight is generated again by the next run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from batchgen.errors import JobError
from batchgen.job.loop import JobLoop
from batchgen.job.result import RunResult
from batchgen.output import manifest as mf
from batchgen.output.card import CARD_FILE, MARKER as CARD_MARKER
from batchgen.output.fingerprint import FILE as FINGERPRINT_FILE
from batchgen.output.lock import WorkerLock
from batchgen.output.numerics import FILE as NUMERICS_FILE
from batchgen.job.spec import JobSpec
from batchgen.job.workers import WorkerInfo

OWNED_PATHS = ("data", "rejects", "manifest", "logs", "reports", FINGERPRINT_FILE, NUMERICS_FILE, "job.yaml")


def write_report_or_say_why(out_dir: Path) -> None:
    """The dataset card, plots and page. The rows are committed already: a failure here is reported, not
    raised (`batchgen report OUT` writes them again)."""
    from batchgen.output.report import write_report

    try:
        for line in write_report(out_dir).notes:
            print(f"batchgen: {line}", file=sys.stderr)
    except Exception as e:
        print(f"batchgen: the report could not be written ({type(e).__name__}: {e}); the output is complete; "
              f"run `batchgen report {out_dir}` to try again", file=sys.stderr)


class _StopFlag:
    """First SIGINT/SIGTERM: finish cleanly. Second: exit at once (commits are atomic, nothing corrupts)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum
        print(f"\nbatchgen: got {signal.Signals(signum).name}: committing finished rows and stopping "
              f"(send it again to exit at once)", flush=True)

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)


def _fresh(out_dir: Path) -> None:
    for name in OWNED_PATHS:
        p = out_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    card = out_dir / CARD_FILE
    if card.is_file() and CARD_MARKER in card.read_text(errors="replace"):  # batchgen's, not a user's README
        card.unlink()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def fresh_start(spec: JobSpec) -> None:
    """Delete what batchgen wrote in the output directory (nothing else), holding worker 0's lock."""
    out_dir = Path(spec.output.dir).resolve()
    if not out_dir.exists():
        return
    lock = WorkerLock(out_dir, mf.worker_tag(0))
    try:
        _fresh(out_dir)
    finally:
        lock.release()


def _clean_failed_start(out_dir: Path, lock: WorkerLock, entries_before: set[str], created: list[Path]) -> None:
    """After a run failed: if all it left is its own new lock file (nothing else was written), remove that,
    and the folders this run created (`created`, the output directory first) while they are empty.
    Anything else stays."""
    if lock.path.name in entries_before:
        return  # the lock file was there before this run
    try:
        if set(os.listdir(out_dir)) - entries_before != {lock.path.name}:
            return  # the run (or another worker) wrote something: leave the directory as it is
        lock.remove()
        for folder in created:
            if any(folder.iterdir()):
                break
            folder.rmdir()
    except OSError:
        pass  # tidying only: the error that stopped the run is the one to report


def run_job(spec: JobSpec, *, fresh: bool = False, worker: WorkerInfo = WorkerInfo(0, 1),
            show_progress: bool = True, tensor_parallel=None) -> RunResult:
    """One worker's run; `tensor_parallel`: the group this process leads (job/ranks.py), None without."""
    if worker.local_rank is not None and spec.model.device == "auto":
        import torch

        if torch.cuda.is_available():  # torchrun: LOCAL_RANK picks this worker's GPU
            spec = spec.model_copy(update={"model": spec.model.model_copy(update={"device": f"cuda:{worker.local_rank}"})})
    out_dir = Path(spec.output.dir).resolve()
    created = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # what mkdir creates, deepest first
    entries_before = set(os.listdir(out_dir)) if out_dir.is_dir() else set()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JobError(f"cannot create output.dir {out_dir}: {e.strerror}") from None
    tag = mf.worker_tag(worker.index)
    lock = WorkerLock(out_dir, tag)
    try:
        if fresh:
            _fresh(out_dir)
        loop = JobLoop(spec, out_dir, worker, show_progress, tensor_parallel)
        _write_atomic(out_dir / "job.yaml", yaml.safe_dump(spec.model_dump(by_alias=True), sort_keys=False))
        with _StopFlag() as stop:
            result = loop.run(stop)
        # the partition this worker used (sized from the source unless the job set worker_unit_rows)
        result.report["worker"].update(unit_rows=loop.worker.unit_rows, source_rows=loop.worker.num_rows)
        if loop.worker.count > 1 and result.rows_committed + result.rows_skipped == 0 \
                and result.interrupted_by is None:
            print(f"batchgen: {loop.worker.why_no_rows()}", file=sys.stderr)
        reports = out_dir / "reports"
        reports.mkdir(exist_ok=True)
        _write_atomic(reports / f"{tag}.json", json.dumps(result.report, indent=2))
        if spec.output.report and result.interrupted_by is None:
            write_report_or_say_why(out_dir)
        return result
    except BaseException:
        _clean_failed_start(out_dir, lock, entries_before, created)
        raise
    finally:
        lock.release()

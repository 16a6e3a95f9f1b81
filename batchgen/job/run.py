"""The job runner, composition root: source -> prompts -> engine -> shard writer, with resume and signals.

Exactly once: rows whose keys a manifest records are skipped; every other row of this worker's part is
generated and committed once. A signal stops admission, commits what is finished and returns; whatever
was in flight is generated again by the next run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from batchgen.errors import JobError
from batchgen.job.loop import JobLoop
from batchgen.job.result import RunResult
from batchgen.job import placement
from batchgen.output import fresh as fresh_mod
from batchgen.output import layout
from batchgen.output import manifest as mf
from batchgen.output.lock import (DIRECTORY_LOCK_FILE, AllWorkersLock, DirectoryLock, WorkerLock, check_partition,
                                  is_held)
from batchgen.output.temp_file import write_text_atomic
from batchgen.config import JobSpec
from batchgen.job.workers import WorkerInfo


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


class StopFlag:
    """First SIGINT/SIGTERM: finish cleanly. Second: exit at once (commits are atomic, nothing corrupts)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
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


def start_over(out_dir: Path, where: placement.Placement, own_lock: WorkerLock | None) -> None:
    """--fresh: every other worker's lock taken (refused while one runs), then batchgen's files out, manifest
    first (output/fresh.py). The caller holds the DirectoryLock."""
    with AllWorkersLock(out_dir, own_lock.path if own_lock is not None else None):
        fresh_mod.start_over(out_dir, [f"it holds {what}" for what in where.inside])


def refuse_a_users_resolved_job(out_dir: Path) -> None:
    """JobError when OUT/job.resolved.yaml exists and batchgen did not write it (it lacks the header line)."""
    path = out_dir / layout.RESOLVED_JOB_FILE
    if path.exists() and not path.read_text(errors="replace").startswith(layout.RESOLVED_JOB_HEADER):
        raise JobError(f"{path} exists and was not written by batchgen (it lacks batchgen's first line); batchgen "
                       f"writes the resolved job there and will not overwrite it: move that file, or give the job "
                       f"an output folder of its own")


def refuse_names_taken_before_marking(out_dir: Path) -> None:
    """JobError when a folder batchgen has not used yet holds files under the names batchgen writes (a user's
    fingerprint.json or reports/index.html): a run would overwrite them, and --fresh later delete them."""
    taken = layout.names_taken_before_marking(out_dir)
    if taken:
        named = ", ".join(taken[:8]) + (f" and {len(taken) - 8} more" if len(taken) > 8 else "")
        raise JobError(f"output.dir {out_dir} is not a batchgen output (no {layout.MARKER_FILE} marker) but holds "
                       f"{named}, named as batchgen names its own files: a run would write over them. Give the job "
                       f"an output folder of its own (output.dir or --output), or move those files out")


def write_resolved_job(out_dir: Path, spec: JobSpec) -> None:
    refuse_a_users_resolved_job(out_dir)
    write_text_atomic(out_dir / layout.RESOLVED_JOB_FILE,
                  layout.RESOLVED_JOB_HEADER + yaml.safe_dump(spec.model_dump(by_alias=True), sort_keys=False))


def fresh_start(spec: JobSpec, job_file: Path | None = None) -> None:
    """Delete what batchgen wrote in the output directory, once for all workers (`--workers N --fresh`);
    refused while any worker runs, or when the folder holds anything else."""
    out_dir = Path(spec.output.dir).resolve()
    where = placement.check(out_dir, spec.source.path, job_file)
    if not out_dir.exists():
        return
    with DirectoryLock(out_dir):
        start_over(out_dir, where, None)


def _start_entries(out_dir: Path, new: set[str], lock: WorkerLock) -> tuple[list[Path], list[Path]] | None:
    """What a start writes, among the top-level entries `new` that appeared in `out_dir` during a run: (files,
    folders) to remove, the marker and this worker's lock file not included; None when any of `new` is something
    else (a shard, a manifest, a report, a foreign file, a temporary of a start killed meanwhile).

    A start writes: the DirectoryLock's file and this worker's lock file, the marker, `fingerprint.json`,
    `upstream_order.json` (a position-keyed chained job),
    `job.resolved.yaml` (batchgen's header), `numerics.json` (engine.deterministic), the folders `data/`,
    `rejects/` and `manifest/` (empty until a commit), `logs/` (this worker's throughput log, once it has logged)
    and `reports/` (this worker's report, written after its loop). Another worker's lock file counts when no live
    process holds it (a worker of the same start that failed too)."""
    tag = lock.path.name.removeprefix(".lock-")
    own_files = {"logs": {f"throughput-{tag}.jsonl"}, "reports": {f"{tag}.json"}}
    files: list[Path] = []
    folders: list[Path] = []
    for name in sorted(new):
        path = out_dir / name
        if name in (DIRECTORY_LOCK_FILE, lock.path.name, layout.MARKER_FILE):
            continue  # the caller's
        if path.is_symlink():
            return None
        if name in layout.OWNED_DIRS and path.is_dir():
            for inner in os.listdir(path):
                inner_path = path / inner
                if inner not in own_files.get(name, ()) or inner_path.is_symlink() or not inner_path.is_file():
                    return None
                files.append(inner_path)
            folders.append(path)
        elif not path.is_file():
            return None
        elif name in ("fingerprint.json", "numerics.json", layout.UPSTREAM_ORDER_FILE) or \
                (name == layout.RESOLVED_JOB_FILE and layout.is_batchgen_entry(out_dir, name)):
            files.append(path)
        elif name.startswith(".lock-w") and layout.is_batchgen_entry(out_dir, name) and not is_held(path):
            files.append(path)
        else:
            return None
    return files, folders


def _clean_failed_start(out_dir: Path, lock: WorkerLock, entries_before: set[str], created: list[Path]) -> None:
    """After a run failed: remove what it wrote, if it committed nothing. Only what appeared in `out_dir` during
    this run (its entries then minus `entries_before`), only when all of that is what a start writes
    (`_start_entries`: else the directory stays as it is), and the folders this run created (`created`, the
    output directory first) while they are empty. While another worker runs only this worker's lock file is
    removed; once any worker has committed (a manifest holds anything: a resume), only this worker's lock file and
    a marker this run added. Best effort: an OSError leaves the rest (the marker goes after the other files, so a
    folder left half cleaned still reads as an output)."""
    if lock.path.name in entries_before:
        return  # the lock file was there before this run
    try:
        with DirectoryLock(out_dir) as starting:  # no other run starts meanwhile
            new = set(os.listdir(out_dir)) - entries_before
            start = _start_entries(out_dir, new, lock)
            if start is None:
                return  # the run (or another worker) wrote something: leave the directory as it is
            if any(is_held(p) for p in out_dir.glob(".lock-w*") if p.name != lock.path.name):
                lock.remove()  # another worker runs: what the start wrote is its output's too
                return
            manifests = out_dir / mf.MANIFEST_DIR
            committed = manifests.is_dir() and bool(os.listdir(manifests))
            if not committed:  # nothing generated: what the start wrote goes, or a next run would resume it
                files, folders = start
                for path in files:
                    path.unlink()
                for folder in folders:
                    folder.rmdir()
            if layout.MARKER_FILE in new:
                (out_dir / layout.MARKER_FILE).unlink()
            lock.remove()
            if DIRECTORY_LOCK_FILE in new:
                starting.remove()
            if committed:
                return
        for folder in created:
            if any(folder.iterdir()):
                break
            folder.rmdir()
    except OSError:
        pass  # tidying only: the error that stopped the run is the one to report


def check_keys_before_any_row(spec: JobSpec, schema=None) -> int | None:
    """With several workers, each sees only its own rows: a key repeated in two workers' rows would be generated
    and committed twice (the output then reads as damaged). So every key of the source is scanned before any row
    is generated, as `batchgen validate` does (a lone worker finds a duplicate as it reaches it: what it committed
    before stays valid). Costs one read of the source in each worker (all of a row's columns are parsed: ~125k
    JSONL rows a second on a CPU core); a duplicate or null key is a JobError (exit 2). Returns the rows scanned
    (None without a key column: nothing scanned)."""
    if spec.source.key_column is None:
        return None
    from batchgen.job.validate import check_keys
    from batchgen.sources import open_source

    t0 = time.monotonic()
    _, num_rows = check_keys(spec, open_source(spec.source), schema)
    print(f"batchgen: {num_rows:,} keys of source.key_column {spec.source.key_column!r} checked unique before "
          f"dealing rows to workers ({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    return num_rows


def run_job(spec: JobSpec, *, fresh: bool = False, worker: WorkerInfo = WorkerInfo(0, 1),
            show_progress: bool = True, tensor_parallel=None, job_file: Path | None = None) -> RunResult:
    """One worker's run; `tensor_parallel`: the group this process leads (job/ranks.py), None without;
    `job_file`: the job's YAML (checked not to lie in the output folder's batchgen files)."""
    if worker.local_rank is not None and spec.model.device == "auto":
        import torch

        if torch.cuda.is_available():  # torchrun: LOCAL_RANK picks this worker's GPU
            spec = spec.model_copy(update={"model": spec.model.model_copy(update={"device": f"cuda:{worker.local_rank}"})})
    out_dir = Path(spec.output.dir).resolve()
    where = placement.check(out_dir, spec.source.path, job_file)  # before anything is created
    created = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # what mkdir creates, deepest first
    entries_before = set(os.listdir(out_dir)) if out_dir.is_dir() else set()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JobError(f"cannot create output.dir {out_dir}: {e.strerror}") from None
    tag = mf.worker_tag(worker.index)
    lock = None
    try:
        # One start at a time (the DirectoryLock): this worker's lock taken with its count recorded, a --fresh
        # done, the partition checked against the running workers', an interrupted --fresh finished, all before
        # anything of the output is read.
        with DirectoryLock(out_dir):
            lock = WorkerLock(out_dir, tag, count=worker.count)
            if fresh:  # refused while any other worker runs (naming it): then no partition can differ
                start_over(out_dir, where, lock)
                # what the old output held is gone: a failure from here on cleans up what this start writes,
                # under the old names too (what survived the fresh: the marker, lock files, stays)
                entries_before = (entries_before & set(os.listdir(out_dir))) - {lock.path.name}
            check_partition(out_dir, lock)
            fresh_mod.finish_interrupted(out_dir)
            refuse_a_users_resolved_job(out_dir)
            refuse_names_taken_before_marking(out_dir)
            layout.write_marker(out_dir)
        if not fresh and where.warning() is not None:
            print(where.warning(), file=sys.stderr)
        loop = JobLoop(spec, out_dir, worker, show_progress, tensor_parallel)
        if loop.worker.count > 1:
            check_keys_before_any_row(spec, loop.schema)
        lock.record_partition(loop.worker.count, loop.worker.unit_rows)  # sized from the source: now known
        with DirectoryLock(out_dir):
            check_partition(out_dir, lock)
        write_resolved_job(out_dir, spec)
        with StopFlag() as stop:
            result = loop.run(stop)
        # the partition this worker used (sized from the source unless the job set worker_unit_rows)
        result.report["worker"].update(unit_rows=loop.worker.unit_rows, source_rows=loop.worker.num_rows)
        if loop.worker.count > 1 and result.rows_committed + result.rows_skipped == 0 \
                and result.interrupted_by is None:
            print(f"batchgen: {loop.worker.why_no_rows()}", file=sys.stderr)
        reports = out_dir / "reports"
        reports.mkdir(exist_ok=True)
        write_text_atomic(reports / f"{tag}.json", json.dumps(result.report, indent=2))
        if spec.output.report and result.interrupted_by is None:
            write_report_or_say_why(out_dir)
        lock.remove()  # a finished worker leaves no lock file behind (a waiting start opens a new one)
        return result
    except BaseException:
        if lock is not None:
            _clean_failed_start(out_dir, lock, entries_before, created)
        raise
    finally:
        if lock is not None:
            lock.release()

"""The shared output directory of a Ray job, from the driver's side (driver.py): made ready once before any actor
starts (placement checks, --fresh, the marker, stale worker tags), and counted once at the end from the manifests.
Every actor then writes into it through the usual commit protocol."""

from __future__ import annotations

import sys
from pathlib import Path

from batchgen.config import JobSpec
from batchgen.errors import JobError
from batchgen.job import placement
from batchgen.job.result import RunResult
from batchgen.job.run import (refuse_names_taken_before_marking, start_over, write_report_or_say_why,
                              write_resolved_job)
from batchgen.output import fresh as fresh_mod
from batchgen.output import layout
from batchgen.output import manifest as mf
from batchgen.output.lock import DirectoryLock, describe, is_held, lock_path, running_workers
from batchgen.ray.slot import Slot


def prepare_output(spec: JobSpec, out_dir: Path, job_file: Path | None, fresh: bool, num_slots: int
                   ) -> tuple[int, int]:
    """Once for all actors: placement checks, --fresh, an interrupted --fresh finished, the marker; the leftovers
    of worker tags this run will not start deleted (an actor deletes its own). Returns the (rows, rejects) the
    output held before this run."""
    where = placement.check(out_dir, spec.source.path, job_file)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JobError(f"cannot create output.dir {out_dir}: {e.strerror}") from None
    with DirectoryLock(out_dir):
        running = running_workers(out_dir)
        if running:
            raise JobError(f"{describe(running[0])} is running in {out_dir}; a Ray job deals every row "
                           f"itself: wait for that run to finish or stop it, then start this one (it resumes)")
        if fresh:
            start_over(out_dir, where, None)
        fresh_mod.finish_interrupted(out_dir)
        refuse_names_taken_before_marking(out_dir)
        layout.write_marker(out_dir)
        ledger = mf.checked_ledger(out_dir)
        stale = mf.tags_from(ledger, num_slots)
        if stale:
            mf.remove_orphans(out_dir, stale, ledger)
        committed_before = committed(ledger)
    if not fresh and where.warning() is not None:
        print(where.warning(), file=sys.stderr)
    write_resolved_job(out_dir, spec)
    return committed_before


def job_result(spec: JobSpec, out_dir: Path, slots: list[Slot], *, base_tokens: int,
               committed_before: tuple[int, int], dealer: str, wall_s: float, signum: int | None) -> RunResult:
    """The job's result, counted from the manifests (a replaced worker's commits count too; its own report died
    with it); `base_tokens`: the tokens of replaced workers; the HTML report written when the job completed."""
    results = [s.result for s in slots if s.result is not None]
    removed = tidy_leftovers(out_dir)
    if removed:
        print(f"batchgen: removed {len(removed)} uncommitted file(s) that killed workers left ({removed[0]}"
              f"{', ...' if len(removed) > 1 else ''}); their rows were committed by others", file=sys.stderr)
    rows, rejects = committed(mf.checked_ledger(out_dir))
    rows_before, rejects_before = committed_before
    tokens = base_tokens + sum(s.result["report"]["generated_tokens"] if s.result else s.generated_tokens
                               for s in slots)
    interrupted = signum if signum is not None else next(
        (r["interrupted_by"] for r in results if r["interrupted_by"] is not None), None)
    report = {"status": "interrupted" if interrupted is not None else "complete", "wall_s": round(wall_s, 3),
              "generated_tokens": tokens, "generated_tok_s": round(tokens / max(wall_s, 1e-9), 2),
              "workers": {r["slot"]: r["report"] for r in results}, "num_workers": len(slots), "dealer": dealer}
    if spec.output.report and interrupted is None:
        write_report_or_say_why(out_dir)
    return RunResult(out_dir, rows - rows_before, rejects - rejects_before, rows_before, interrupted, report)


def tidy_leftovers(out_dir: Path) -> list[str]:
    """Once every actor has stopped: delete what a killed worker left (the shard it renamed into data/ before its
    record was written, its temporaries). Its replacement would have deleted them as it started, but a job whose
    other workers finished the dealt-again units never starts one: the shards would stay in data/ beside the same
    rows committed by another worker (load_dataset("OUT") read them twice). Workers whose lock a live process
    holds (none, at the end of a job) keep theirs."""
    with DirectoryLock(out_dir):
        ledger = mf.checked_ledger(out_dir)
        tags = {o.tag for o in ledger.orphans if o.kind in ("tmp", "leftover") and o.tag is not None}
        idle = {t for t in tags if not is_held(lock_path(out_dir, t))}
        return mf.remove_orphans(out_dir, idle, ledger) if idle else []


def committed(ledger) -> tuple[int, int]:
    """(rows, rejects) an output's records hold."""
    return (sum(e.record["num_rows"] for e in ledger.entries), sum(e.record["num_rejects"] for e in ledger.entries))

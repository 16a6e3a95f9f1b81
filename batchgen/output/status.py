"""`batchgen status`: progress, rates and ETA of an output directory, from what is on disk.

Per worker: committed rows from its manifest; running or stopped from whether a process holds its lock
(`.lock-wNNNNN`, probed without blocking); the latest run's progress and rate from its throughput log
(`logs/throughput-wNNNNN.jsonl`, a record every ~5 s: rows finished and committed in that run, seconds since
it began generating); how its last run ended from its report. An ETA is given only while a worker runs."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from batchgen.errors import JobError
from batchgen.output import manifest as mf
from batchgen.output.layout import refuse_pending_fresh, resolved_job_path
from batchgen.output.lock import holder, is_held

STALLED_AFTER_S = 600  # a running worker without a commit for this long is flagged
LOG_TAIL_BYTES = 1 << 16  # a throughput record is ~1 KB: the last one is in the file's last 64 KiB
TAG = re.compile(r"w\d{5}")


@dataclass
class _Worker:
    tag: str
    rows: int = 0  # committed input rows (rejects included), all runs
    rejects: int = 0
    tokens: int = 0
    last_commit: float | None = None  # unix time
    running: bool = False  # a live process holds the worker's lock
    dealer: str | None = None  # who deals its rows while it runs ("ray <host>:<pid>"); None: a fixed partition
    started: float | None = None  # unix time the latest run took the lock (the lock file's mtime)
    log: dict | None = None  # the last throughput record
    report: dict | None = None  # reports/wNNNNN.json: written when a run ends normally (done or signalled)
    report_damaged: str | None = None  # the report's path when it is not a JSON object

    @property
    def latest_log(self) -> dict | None:
        """The last throughput record if it belongs to the latest run (None before that run's first one)."""
        if self.log is None or (self.started is not None and self.log.get("time", 0) < self.started):
            return None
        return self.log

    @property
    def rate_rows_s(self) -> float | None:
        rec = self.latest_log
        if rec is None or rec.get("elapsed_s", 0) <= 0:
            return None
        return rec["rows_done"] / rec["elapsed_s"]

    @property
    def uncommitted(self) -> int:
        """Rows a running worker has finished in this run but not committed yet."""
        rec = self.latest_log
        return max(0, rec["rows_done"] - rec["rows_committed"]) if self.running and rec else 0


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _last_record(path: Path) -> dict | None:
    """The last complete JSON line of a log (a line torn by kill -9 is skipped)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - LOG_TAIL_BYTES))
        lines = f.read().split(b"\n")[:-1]  # text after the last newline is torn or empty
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:  # not JSON, or not text (NUL bytes): a damaged line is skipped like a torn one
            continue
        if isinstance(record, dict) and all(isinstance(record.get(k), (int, float))
                                            for k in ("time", "elapsed_s", "rows_done", "rows_committed")):
            return record
    return None


def _records_a_process(lock: Path) -> bool:
    """Whether a lock file holds what a batchgen run writes in it: its pid (a JSON record, or the pid alone)."""
    pid = holder(lock)["pid"]
    return isinstance(pid, int) or (isinstance(pid, str) and pid.isdigit())


def _read_workers(out_dir: Path) -> dict[str, _Worker]:
    workers: dict[str, _Worker] = {}

    def worker(tag: str) -> _Worker | None:
        return workers.setdefault(tag, _Worker(tag)) if TAG.fullmatch(tag) else None

    for tag, r in mf.read_all(out_dir):
        w = worker(tag)
        w.rows, w.rejects = w.rows + r["num_rows"], w.rejects + r["num_rejects"]
        w.tokens += r["num_completion_tokens"]
        w.last_commit = max(w.last_commit or 0.0, r["time"])
    committed = set(workers)
    for lock in out_dir.glob(".lock-w*"):
        if (w := worker(lock.name.removeprefix(".lock-"))) is not None:
            try:
                w.started = lock.stat().st_mtime
            except FileNotFoundError:  # removed meanwhile (a failed start cleaning up)
                continue
            w.running = is_held(lock)
            if w.running:
                w.dealer = holder(lock).get("dealer")
            elif not _records_a_process(lock) and w.tag not in committed:
                del workers[w.tag]  # a file under a lock's name that no batchgen run wrote: no worker
    for log in (out_dir / "logs").glob("throughput-w*.jsonl"):
        if (w := worker(log.stem.removeprefix("throughput-"))) is not None:
            w.log = _last_record(log)
    for report in (out_dir / "reports").glob("w*.json"):
        if (w := worker(report.stem)) is not None:
            try:
                w.report = json.loads(report.read_bytes())
            except (OSError, ValueError):  # status reads it for how a run ended only: say so, go on
                w.report_damaged = f"reports/{report.name}"
                continue
            if not isinstance(w.report, dict):
                w.report, w.report_damaged = None, f"reports/{report.name}"
    return workers


def _expected_rows(out_dir: Path, open_source) -> int | None:
    job = resolved_job_path(out_dir)
    if not job.exists() or open_source is None:
        return None
    try:
        from batchgen.config import SourceSpec

        spec = SourceSpec.model_validate(yaml.safe_load(job.read_text())["source"])
        source = open_source(spec)
        if source.expected_rows is None and hasattr(source, "count_rows"):
            return source.count_rows()
        return source.expected_rows
    except Exception:  # the source may have moved; status still reports what is on disk
        return None


def _worker_line(w: _Worker, now: float, rows_remain: bool) -> str:
    committed = f"{w.rows} rows committed, {w.tokens} tokens"
    rate = w.rate_rows_s
    if w.running:
        rec = w.latest_log
        line = (f"running{f' for {_ago(now - w.started)}' if w.started is not None else ''}"
                f"{f' (rows dealt by {w.dealer})' if w.dealer else ''}; {committed}")
        if rec is None and w.started is not None and (w.last_commit or 0) >= w.started:
            line += "; committing in this run, no throughput record yet (one comes every ~5 s)"
        elif rec is None:
            line += "; no row finished yet in this run (loading the model or in its first steps)"
        else:
            line += f" (+{w.uncommitted} finished, not committed yet)" if w.uncommitted else ""
            line += f"; {rate:.2f} rows/s" if rate is not None else ""
            this_run = w.last_commit is not None and (w.started is None or w.last_commit >= w.started)
            line += f"; last commit {_ago(now - w.last_commit)} ago" if this_run else "; no commit yet in this run"
        quiet_since = max(w.last_commit or 0.0, w.started or 0.0)  # the latest commit or start
        if rows_remain and quiet_since and now - quiet_since > STALLED_AFTER_S:
            line += f"  (no commit for {_ago(now - quiet_since)}: stalled?)"
        return line
    line = f"stopped; {committed}"
    report_time = (w.report or {}).get("time")
    if report_time is not None and (w.started is None or report_time >= w.started):
        line += f"; its last run ended {_ago(now - report_time)} ago ({w.report.get('status', '?')})"
    elif w.started is not None:
        line += (f"; its last run (started {_ago(now - w.started)} ago) ended without a report: killed, or it "
                 f"failed (its error message says why)")
    line += f"; {rate:.2f} rows/s in that run" if rate is not None else ""
    if w.report_damaged:
        line += (f"; its run report {w.report_damaged} is damaged (not JSON): its next run rewrites it, or delete "
                 f"it")
    return line


def _what_is_there(out_dir: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in out_dir.iterdir())
    if not names:
        return "it is empty"
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "")
    return f"it holds: {shown}"


def describe(out_dir: Path, open_source=None) -> str:
    """What is on disk in a job's output directory. `open_source` (sources.open_source, given by the caller: output/
    sits below sources/) reads the job's source for its row count; None: progress without a total."""
    if not out_dir.is_dir():
        raise JobError(f"{out_dir} does not exist: no batchgen run has written there yet")
    refuse_pending_fresh(out_dir)
    workers = _read_workers(out_dir)
    if not workers:
        raise JobError(f"{out_dir} holds no batchgen output (no {mf.MANIFEST_DIR}/, logs, reports or worker "
                       f"locks); {_what_is_there(out_dir)}")
    expected = _expected_rows(out_dir, open_source)
    total = sum(w.rows for w in workers.values())
    uncommitted = sum(w.uncommitted for w in workers.values())
    rows_remain = expected is None or total < expected
    now = time.time()
    lines = [f"{out_dir}: {total} rows committed"
             + (f" of {expected} ({100 * total / max(expected, 1):.1f}%)" if expected else "")
             + (f" (+{uncommitted} finished, not committed yet)" if uncommitted else "")
             + f", {sum(w.rejects for w in workers.values())} rejected, "
               f"{sum(w.tokens for w in workers.values())} completion tokens"]
    lines += [f"  {tag}: {_worker_line(w, now, rows_remain)}" for tag, w in sorted(workers.items())]
    running = [w for w in workers.values() if w.running]
    if expected and total >= expected:
        lines.append("complete")
    elif running:
        rate = sum(w.rate_rows_s or 0.0 for w in running)
        summary = f"{len(running)} of {len(workers)} workers running"
        if rate > 0:
            summary += f"; rate {rate:.2f} rows/s"
            if expected:
                summary += f"; ETA {max(expected - total - uncommitted, 0) / rate / 60:.1f} min"
        lines.append(summary)
    else:
        left = f"{expected - total} rows remain; " if expected else ""
        lines.append(f"no worker is running: {left}run the same command again to resume")
    if not (out_dir / mf.MANIFEST_DIR).is_dir() and not running:
        lines.append(f"nothing was committed here; {_what_is_there(out_dir)}")
    return "\n".join(lines)

"""`batchgen status`: progress, rate and ETA of an output directory from its manifests alone."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from batchgen.errors import JobError
from batchgen.output import manifest as mf


def _expected_rows(out_dir: Path) -> int | None:
    job = out_dir / "job.yaml"
    if not job.exists():
        return None
    try:
        from batchgen.sources import open_source
        from batchgen.job.spec import SourceSpec

        spec = SourceSpec.model_validate(yaml.safe_load(job.read_text())["source"])
        source = open_source(spec)
        if source.expected_rows is None and hasattr(source, "count_rows"):
            return source.count_rows()
        return source.expected_rows
    except Exception:  # the source may have moved; status still reports what is on disk
        return None


def describe(out_dir: Path) -> str:
    if not (out_dir / mf.MANIFEST_DIR).is_dir():
        raise JobError(f"{out_dir} holds no batchgen output (no {mf.MANIFEST_DIR}/ folder)")
    per_worker: dict[str, dict] = {}
    for tag, r in mf.read_all(out_dir):
        w = per_worker.setdefault(tag, {"rows": 0, "rejects": 0, "tokens": 0, "first": r["time"], "last": r["time"]})
        w["rows"] += r["num_rows"]
        w["rejects"] += r["num_rejects"]
        w["tokens"] += r["num_completion_tokens"]
        w["first"], w["last"] = min(w["first"], r["time"]), max(w["last"], r["time"])
    expected = _expected_rows(out_dir)
    total = sum(w["rows"] for w in per_worker.values())
    now = time.time()
    lines = [f"{out_dir}: {total} rows committed"
             + (f" of {expected} ({100 * total / max(expected, 1):.1f}%)" if expected else "")
             + f", {sum(w['rejects'] for w in per_worker.values())} rejected, "
               f"{sum(w['tokens'] for w in per_worker.values())} completion tokens"]
    rate_total = 0.0
    for tag, w in sorted(per_worker.items()):
        span = w["last"] - w["first"]
        rate = w["rows"] / span if span > 0 else 0.0
        rate_total += rate
        idle = now - w["last"]
        lines.append(f"  {tag}: {w['rows']} rows, {w['tokens']} tokens, {rate:.2f} rows/s, last commit "
                     f"{idle:.0f}s ago" + ("  (stalled?)" if idle > 600 and (expected is None or total < expected)
                                         else ""))
    reports = sorted((out_dir / "reports").glob("w*.json")) if (out_dir / "reports").is_dir() else []
    finished = [json.loads(p.read_text()).get("status") for p in reports]
    if expected and total < expected and rate_total > 0:
        lines.append(f"rate {rate_total:.2f} rows/s; ETA {(expected - total) / rate_total / 60:.1f} min")
    elif expected and total >= expected:
        lines.append("complete")
    if finished:
        lines.append(f"worker reports: {', '.join(f'{p.stem}={s}' for p, s in zip(reports, finished))}")
    return "\n".join(lines)

"""The output directory's dataset card, `OUT/README.md`, and the statistics behind it.

The card is a Hugging Face dataset card: its YAML front matter points `configs` at `data/*.parquet`, so
`datasets.load_dataset(OUT)` and the Hub's viewer read the completions (not the rejects, not the manifest).
Its body says what the data is: row counts, columns, prompt and completion lengths, finish reasons, rejects by
class, the model and sampling settings, the resolved job spec, the batchgen version and the run's throughput.
Everything is read back from what the run committed (manifests, shards, reports), so `batchgen report OUT`
rebuilds it at any time; shards no manifest names (a crash's leftovers) are not counted.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import yaml

from batchgen.errors import JobError
from batchgen.output import manifest as mf
from batchgen.output.layout import CARD_MARKER, resolved_job_path
from batchgen.output.damage import FINGERPRINT_FIX, load_json

CARD_FILE = "README.md"
MARKER = CARD_MARKER


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {}
    p = np.percentile(values, [5, 50, 95])
    return {"mean": round(float(values.mean()), 1), "p5": round(float(p[0]), 1), "p50": round(float(p[1]), 1),
            "p95": round(float(p[2]), 1), "max": int(values.max())}


def collect(out_dir: Path) -> dict[str, Any]:
    """What the card reports, from the committed output."""
    out_dir = Path(out_dir)
    ledger = mf.checked_ledger(out_dir)  # read and checked once (a KeySet of every key: not three times)
    data = [path for path, _ in ledger.shards("data")]
    stats: dict[str, Any] = {"num_data_files": len(data), "num_rows": 0, "num_input_rows": 0, "columns": [],
                             "prompt_tokens": {}, "completion_tokens": {}, "finish_reasons": {}, "rejects": {}}
    if data:
        schema = pq.read_schema(data[0])
        stats["columns"] = [(f.name, str(f.type)) for f in schema]
        wanted = [c for c in ("num_prompt_tokens", "num_completion_tokens", "finish_reason") if c in schema.names]
        table = pq.read_table(data, columns=wanted)
        stats["num_rows"] = table.num_rows
        if "num_prompt_tokens" in wanted:
            stats["prompt_tokens"] = _percentiles(table["num_prompt_tokens"].to_numpy())
        if "num_completion_tokens" in wanted:
            completion = table["num_completion_tokens"].to_numpy()
            stats["completion_tokens"] = _percentiles(completion)
            stats["total_completion_tokens"] = int(completion.sum())
        if "finish_reason" in wanted:
            stats["finish_reasons"] = dict(Counter(table["finish_reason"].to_pylist()).most_common())
    rejects = [path for path, _ in ledger.shards("rejects")]
    if rejects:
        classes = pq.read_table(rejects, columns=["error_class"])["error_class"].to_pylist()
        stats["rejects"] = dict(Counter(classes).most_common())
    stats["num_input_rows"] = sum(e.record.get("num_rows", 0) for e in ledger.entries)
    job_path = resolved_job_path(out_dir)
    stats["job"] = yaml.safe_load(job_path.read_text()) if job_path.exists() else {}
    fp_path = out_dir / "fingerprint.json"
    stored = load_json(fp_path, FINGERPRINT_FIX) if fp_path.exists() else {}
    components = stored.get("components", {}) if isinstance(stored, dict) else {}
    stats["batchgen_version"] = components.get("batchgen_version")
    stats["runs"] = _runs(out_dir)
    return stats


# What the card's throughput table shows of each worker's run report (every run writes all of them), and what
# each must be: a status text, or a number that is finite and not negative.
RUN_REPORT_KEYS = {"status": "text", "rows_committed": "number", "generated_tokens": "number", "wall_s": "number",
                   "setup_s": "number"}


def _is_count(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _runs(out_dir: Path) -> list[dict[str, Any]]:
    """Each worker's latest run report: its rows, tokens, wall time and rate.

    A report that lacks one of RUN_REPORT_KEYS, or holds a value of the wrong kind there (null, text for a
    number), is damaged: a JobError (exit 2) naming the file and the key, like a report that is not JSON. It is
    not skipped: the card states each worker's throughput, and a card that quietly leaves a worker out (or shows
    its tokens as blank) would read as a complete account when it is not; the user decides (delete the report and
    the card is written without that worker, or the worker's next run writes it again). At the end of `batchgen
    run` the rows are committed already: the run reports this error and exits 0 (job/run.py
    write_report_or_say_why)."""
    runs = []
    for path in sorted((out_dir / "reports").glob("w*.json")):
        fix = (f"delete it (worker {path.stem}'s next run writes it again) and run `batchgen report {out_dir}` "
               f"again")
        r = load_json(path, fix)
        if not isinstance(r, dict):
            raise JobError(f"{path} is damaged (not a JSON object): {fix}")
        for key, kind in RUN_REPORT_KEYS.items():
            if key not in r:
                raise JobError(f"{path} is damaged (no {key!r} key; every run report has one): {fix}")
            if not (isinstance(r[key], str) if kind == "text" else _is_count(r[key])):
                raise JobError(f"{path} is damaged ({key!r} is {json.dumps(r[key])[:60]}, not a "
                               f"{'text' if kind == 'text' else 'number of 0 or more'}): {fix}")
        runs.append({"worker": path.stem, "status": r["status"], "rows_committed": r["rows_committed"],
                     "generated_tokens": r["generated_tokens"], "wall_s": r["wall_s"], "setup_s": r["setup_s"],
                     "tok_s": round(r["generated_tokens"] / r["wall_s"], 1) if r["wall_s"] else None})
    return runs


def _size_category(n: int) -> str:
    for bound, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"),
                        (1_000_000, "100K<n<1M"), (10_000_000, "1M<n<10M")):
        if n < bound:
            return name
    return "n>10M"


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render(stats: dict[str, Any], name: str, out_dir: Path) -> str:
    """The card's text: YAML front matter, then the body. Its load snippet names `out_dir` as an absolute path
    (`batchgen report OUT` writes it again after a move)."""
    front = {
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": "data/*.parquet"}]}],
        "size_categories": [_size_category(stats["num_rows"])],
        "tags": ["synthetic", "batchgen"],
    }
    job = stats["job"]
    model = job.get("model", {})
    model_name = model.get("path") or model.get("name") or "?"
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", MARKER, "", f"# {name}", "",
             f"Completions generated by batchgen {stats['batchgen_version'] or ''} with "
             f"`{model_name}`: {stats['num_rows']:,} rows in {stats['num_data_files']} Parquet files under "
             f"`data/` (one row per input row and sample), from {stats['num_input_rows']:,} input rows "
             f"({sum(stats['rejects'].values()):,} rejected, under `rejects/`).", "",
             "```python", "import datasets",
             f'ds = datasets.load_dataset({json.dumps(str(Path(out_dir).resolve()))}, split="train")',
             "```", "", "## Columns", "", _table(("column", "type"), stats["columns"]), ""]
    length_rows = [(k, *(v.get(s, "") for s in ("mean", "p5", "p50", "p95", "max")))
                   for k, v in (("prompt tokens", stats["prompt_tokens"]),
                                ("completion tokens", stats["completion_tokens"])) if v]
    if length_rows:
        lines += ["## Lengths", "", _table(("", "mean", "p5", "p50", "p95", "max"), length_rows), ""]
    if stats["finish_reasons"]:
        lines += ["## Finish reasons", "", _table(("finish_reason", "rows"), list(stats["finish_reasons"].items())),
                  ""]
    if stats["rejects"]:
        lines += ["## Rejected rows", "", _table(("error_class", "rows"), list(stats["rejects"].items())), ""]
    if stats["runs"]:
        lines += ["## Throughput (each worker's latest run)", "",
                  _table(("worker", "status", "rows committed", "generated tokens", "loop s", "set-up s",
                          "generated tok/s"),
                         [tuple(r[k] for k in ("worker", "status", "rows_committed", "generated_tokens", "wall_s",
                                               "setup_s", "tok_s")) for r in stats["runs"]]), ""]
    sampling = job.get("sampling", {})
    if sampling:
        lines += ["## Sampling", "", _table(("setting", "value"), [(k, json.dumps(v)) for k, v in sampling.items()]),
                  ""]
    lines += ["## Job", "", "The resolved job spec of the latest run:", "", "```yaml",
              yaml.safe_dump(job, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def write_card(out_dir: Path, stats: dict[str, Any] | None = None, name: str | None = None) -> Path | None:
    """Write `OUT/README.md` atomically (workers finishing together each write a complete card); None, and
    nothing written, when a README.md that batchgen did not write is there. `stats`: `collect(out_dir)`, when
    the caller has it already."""
    out_dir = Path(out_dir)
    path = out_dir / CARD_FILE
    if path.exists() and MARKER not in path.read_text(errors="replace"):
        return None
    stats = stats if stats is not None else collect(out_dir)
    text = render(stats, name or stats["job"].get("name") or out_dir.name, out_dir)
    tmp = path.with_name(f".{CARD_FILE}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path

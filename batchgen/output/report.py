"""`batchgen report OUT` (and the end of every run): the dataset card, the plots and a page that shows them.

Writes `OUT/README.md` (output/card.py), `OUT/reports/throughput.png` and `OUT/reports/lengths.png`
(output/plots.py) and `OUT/reports/index.html`: the card's figures, the job's settings, a few sample rows and the
plots, readable offline in any browser. Every text from the data or the job file is HTML-escaped (a completion
may hold markup). Each file is written whole under a temporary name and renamed, so workers finishing together
leave complete files.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from batchgen.errors import JobError
from batchgen.output.card import CARD_FILE, collect, write_card
from batchgen.output.damage import what_to_do
from batchgen.output.manifest import committed_shards
from batchgen.output.plots import lengths_png, log_notes, throughput_png


def _replace(path: Path, write) -> Path | None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        if write(tmp) is None:
            return None
        os.replace(tmp, path)
        return path
    finally:
        tmp.unlink(missing_ok=True)


NUM_SAMPLE_ROWS = 5
MAX_CELL_CHARS = 600  # a sample cell's text beyond this is cut (the data holds it whole)
TEXT_COLUMNS = ("prompt", "reasoning", "completion")  # wrapped, wide; other cells on one line
SETTINGS_SECTIONS = ("model", "source", "prompt", "sampling")  # shown as a table; the whole job below it


def _flat(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """A job section as (dotted key, value) rows; lists and nulls as JSON."""
    if isinstance(value, dict) and value:
        return [row for k, v in value.items() for row in _flat(v, f"{prefix}.{k}" if prefix else str(k))]
    return [(prefix, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))]


def _cut(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= MAX_CELL_CHARS else text[:MAX_CELL_CHARS] + f"… ({len(text):,} characters)"


def sample_rows(out_dir: Path, num_rows: int = NUM_SAMPLE_ROWS) -> tuple[list[str], list[dict]]:
    """(columns, rows): the first rows of the committed data shards, in their order, with every column but the
    per-token lists (log-probs, token ids)."""
    data = committed_shards(out_dir, "data")
    if not data:
        return [], []
    columns = [f.name for f in pq.read_schema(data[0]) if not pa.types.is_list(f.type)]
    rows: list[dict] = []
    for path in data:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=num_rows - len(rows), columns=columns):
            rows += batch.to_pylist()[:num_rows - len(rows)]
            if len(rows) == num_rows:
                return columns, rows
    return columns, rows


def _page(stats: dict, images: list[str], name: str, samples: tuple[list[str], list[dict]]) -> str:
    def table(rows) -> str:
        return "<table>" + "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                                   for k, v in rows) + "</table>"

    summary = [("rows (completions)", f"{stats['num_rows']:,}"), ("input rows", f"{stats['num_input_rows']:,}"),
               ("rejected", f"{sum(stats['rejects'].values()):,}"), ("data files", stats["num_data_files"]),
               ("batchgen", stats["batchgen_version"])]
    parts = [f"<!doctype html><meta charset=utf-8><title>{html.escape(name)}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
             "th{text-align:left;padding-right:1em;vertical-align:top}td{vertical-align:top}img{max-width:100%}"
             "table.rows{border-collapse:collapse;font-size:90%}table.rows td,table.rows th{border:1px solid #ccc;"
             "padding:4px}table.rows td{white-space:nowrap}table.rows td.text{white-space:pre-wrap;overflow-wrap:anywhere;"
             "min-width:24em}"
             ".figures{display:flex;flex-wrap:wrap;gap:0 3em}"
             "pre{background:#f6f6f6;padding:1em;overflow-x:auto}</style>",
             f"<h1>{html.escape(name)}</h1>", table(summary)]
    columns, rows = samples
    if rows:
        head = "".join(f"<th>{html.escape(c).replace('_', '_<wbr>')}</th>" for c in columns)  # long names wrap
        cls = {c: ' class="text"' if c in TEXT_COLUMNS else "" for c in columns}
        body = "".join("<tr>" + "".join(f"<td{cls[c]}>{html.escape(_cut(r[c]))}</td>" for c in columns) + "</tr>"
                       for r in rows)
        parts += [f"<h2>Sample rows (the first {len(rows)})</h2>",
                  f'<div style="overflow-x:auto"><table class="rows"><tr>{head}</tr>{body}</table></div>']
    figures = [(title, pairs) for title, pairs in (
        ("Prompt tokens", stats["prompt_tokens"].items()), ("Completion tokens", stats["completion_tokens"].items()),
        ("Finish reasons", stats["finish_reasons"].items()), ("Rejects by class", stats["rejects"].items()),
        *((f"Run report {run['worker']}", run.items()) for run in stats["runs"])) if pairs]
    if figures:
        parts += ['<div class="figures">'] + [f"<div><h2>{html.escape(title)}</h2>{table(pairs)}</div>"
                                               for title, pairs in figures] + ["</div>"]
    parts += [f'<p><img src="{html.escape(img)}" alt="{html.escape(img)}"></p>' for img in images]
    job = stats["job"]
    if job:
        parts += ["<h2>Job settings</h2>",
                  table([row for section in SETTINGS_SECTIONS if section in job
                         for row in _flat(job[section], section)]),
                  "<details><summary>The whole resolved job file (job.resolved.yaml)</summary><pre>"
                  + html.escape(yaml.safe_dump(job, sort_keys=False)) + "</pre></details>"]
    return "\n".join(parts) + "\n"


@dataclass
class Report:
    files: list[Path] = field(default_factory=list)  # written
    notes: list[str] = field(default_factory=list)  # what was not written, and why


def write_report(out_dir: Path) -> Report:
    """Write the card, the plots and the page."""
    out_dir = Path(out_dir)
    if not (out_dir / "manifest").is_dir():
        raise JobError(f"{out_dir} is not a batchgen output directory (it has no manifest/ folder)")
    reports = out_dir / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    try:
        stats = collect(out_dir)  # every record checked first (OutputDamaged names what does not check out)
    except (pa.ArrowException, OSError) as e:  # a shard of the recorded size whose bytes were damaged
        raise JobError(f"a committed shard of {out_dir} cannot be read ({str(e).splitlines()[0][:200]}); "
                       f"{what_to_do(out_dir)}") from None
    report = Report()
    report.notes += log_notes(out_dir)
    card = write_card(out_dir, stats)
    if card is None:
        report.notes.append(f"{out_dir / CARD_FILE} exists and was not written by batchgen: left as is, no "
                            f"dataset card written")
    else:
        report.files.append(card)
    images = []
    for name, plot in (("throughput.png", throughput_png), ("lengths.png", lengths_png)):
        path = _replace(reports / name, lambda tmp, plot=plot: plot(out_dir, tmp))
        if path is not None:
            report.files.append(path)
            images.append(name)
    name = stats["job"].get("name") or out_dir.name
    page = _page(stats, images, name, sample_rows(out_dir))
    report.files.append(_replace(reports / "index.html", lambda tmp: _write_text(tmp, page)))
    return report


def _write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path

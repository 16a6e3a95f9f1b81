"""Plots of a job's output (PNG, headless: matplotlib's Figure API, no pyplot state, no display).

- throughput: generated tok/s over time (one line per worker; each run of a worker is its own segment), the
  running and waiting sequences, and the KV cache's use, from `logs/throughput-wNNNNN.jsonl`. Rates are computed
  over windows of the log's cumulative token count (window_rates), so a run's last, short interval (the final
  record, forced when the run ends) does not stand alone as a spike that flattens the rest of the curve;
- lengths: histograms of completion and prompt lengths in tokens, from the committed data shards.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from batchgen.output.manifest import committed_shards


# The fields of a throughput-log record the plot reads: `time` and `elapsed_s` in every record, the others where
# the record has them (older logs lack some).
REQUIRED_FIELDS = ("time", "elapsed_s")
PLOTTED_FIELDS = ("num_generated_tokens", "generated_tokens", "num_running", "num_waiting", "kv_cache_usage")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_record(record) -> bool:
    """A JSON object whose fields the plot reads are finite numbers: `time` and `elapsed_s` present, the others
    absent or numbers (a null, a text, NaN or Infinity there makes the whole record damaged)."""
    return isinstance(record, dict) and all(_number(record.get(k)) for k in REQUIRED_FIELDS) \
        and all(_number(record[k]) for k in PLOTTED_FIELDS if k in record)


def _read_log(path: Path) -> tuple[list[dict], int]:
    """A throughput log's records, and how many complete lines are not records (damaged: skipped): not JSON, or
    a field the plot reads null or not a number (_is_record). Read as bytes line by line: a damaged line (NUL
    bytes, an edit) costs its own point only. The text after the last newline is a line cut by a crash, or
    empty."""
    records, damaged = [], 0
    *lines, tail = path.read_bytes().split(b"\n")
    for line in [*lines, tail]:
        try:
            record = json.loads(line)
        except ValueError:
            damaged += line is not tail
            continue
        if _is_record(record):
            records.append(record)
        else:
            damaged += 1
    return records, damaged


def _records(out_dir: Path) -> dict[str, list[dict]]:
    logs = {}
    for path in sorted((out_dir / "logs").glob("throughput-w*.jsonl")):
        records, _ = _read_log(path)
        if records:
            logs[path.stem.removeprefix("throughput-")] = records
    return logs


def log_notes(out_dir: Path) -> list[str]:
    """One note per throughput log with damaged lines (the plot skips them)."""
    notes = []
    for path in sorted((out_dir / "logs").glob("throughput-w*.jsonl")):
        _, damaged = _read_log(path)
        if damaged:
            notes.append(f"logs/{path.name}: {damaged} damaged lines (not JSON records, or a field the plot reads "
                         f"is null or not a number) left out of the throughput plot; the log is diagnostics only, "
                         f"the committed rows are not affected")
    return notes


# The engine's count of tokens as they are generated (every step's); older logs only have the finished rows'
# count, which moves in jumps when rows finish.
RATE_COUNTS = ("num_generated_tokens", "generated_tokens")
MAX_WINDOWS = 60  # a long run's rate is drawn over at most about this many windows


def window_rates(records: list[dict]) -> list[tuple[float, float, float]]:
    """(start, end, generated tok/s) over consecutive windows of one run's records (`time` in seconds): each window
    spans at least the records' median interval and 1/MAX_WINDOWS of the run, and a short remainder at the end
    joins the window before it. A run of a single record gets one window from its start (`elapsed_s` before)."""
    key = next((k for k in RATE_COUNTS if any(k in r for r in records)), None)
    if key is None or not records:
        return []
    points = [(float(r["time"]), float(r.get(key, 0))) for r in records]
    if len(points) == 1:
        t, count = points[0]
        start = t - float(records[0]["elapsed_s"])
        return [(start, t, count / (t - start))] if t > start else []
    gaps = sorted(b[0] - a[0] for a, b in zip(points, points[1:]))
    min_window = max(gaps[len(gaps) // 2], (points[-1][0] - points[0][0]) / MAX_WINDOWS, 1e-9)
    edges = [0]
    for i in range(1, len(points)):
        if points[i][0] - points[edges[-1]][0] >= min_window:
            edges.append(i)
    if edges[-1] != len(points) - 1:  # a remainder shorter than a window: the last window takes it
        if len(edges) > 1:
            edges[-1] = len(points) - 1
        else:
            edges.append(len(points) - 1)
    return [(points[a][0], points[b][0], (points[b][1] - points[a][1]) / max(points[b][0] - points[a][0], 1e-9))
            for a, b in zip(edges, edges[1:])]


def throughput_png(out_dir: Path, path: Path) -> Path | None:
    """Three stacked panels against wall-clock time since the first run started; None without any log."""
    from matplotlib.figure import Figure

    logs = _records(out_dir)
    if not logs:
        return None
    t0 = min(r["time"] - r["elapsed_s"] for records in logs.values() for r in records)  # the first run's start
    span_s = max(r["time"] for records in logs.values() for r in records) - t0
    unit, per = ("hours", 3600) if span_s > 3 * 3600 else ("minutes", 60) if span_s > 300 else ("seconds", 1)
    fig = Figure(figsize=(9, 7), layout="constrained")
    rate, seqs, kv = fig.subplots(3, 1, sharex=True)
    style = dict(marker="o", markersize=3)  # a short run has a record or two: points, not only lines
    for worker, records in logs.items():
        # a new run of the worker (its elapsed time restarts) begins a new segment: a None gap breaks the line
        records = [g for prev, r in zip([None] + records[:-1], records)
                   for g in ([None] if prev is not None and r["elapsed_s"] < prev["elapsed_s"] else []) + [r]]
        t = [float("nan") if r is None else (r["time"] - t0) / per for r in records]
        runs: list[list[dict]] = [[]]
        for r in records:
            if r is None:
                runs.append([])
            else:
                runs[-1].append(r)
        records = [r or {} for r in records]
        nan = float("nan")
        rate_t, rate_v = [], []  # steps: each window's rate from its start to its end, a gap between runs
        for run in runs:
            windows = window_rates(run)
            if windows:
                rate_t += [(s - t0) / per for s, _, _ in windows] + [(windows[-1][1] - t0) / per, nan]
                rate_v += [v for _, _, v in windows] + [windows[-1][2], nan]
        rate.plot(rate_t, rate_v, drawstyle="steps-post", label=worker)
        seqs.plot(t, [r.get("num_running", nan) for r in records], label=f"{worker} running", **style)
        seqs.plot(t, [r.get("num_waiting", nan) for r in records], linestyle="--", label=f"{worker} waiting",
                  **style)
        kv.plot(t, [100 * r.get("kv_cache_usage", nan) for r in records], label=worker, **style)
    rate.set_ylabel("generated tok/s")
    rate.set_ylim(bottom=0)
    rate.set_title("Throughput (generated tokens over windows of the run)")
    seqs.set_ylabel("sequences")
    kv.set_ylabel("KV cache used (%)")
    kv.set_xlabel(f"{unit} since the first run started")
    for ax in (rate, seqs, kv):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.savefig(path, dpi=100)
    return path


def _token_bins(values: np.ndarray, max_bins: int = 50) -> np.ndarray | int:
    """Histogram edges between whole token counts (each bar a whole number of tokens wide), at most max_bins."""
    if len(values) == 0:
        return max_bins
    lo, hi = int(values.min()), int(values.max())
    width = max(1, math.ceil((hi - lo + 1) / max_bins))
    return np.arange(lo, hi + width + 1, width) - 0.5


def lengths_png(out_dir: Path, path: Path) -> Path | None:
    """Histograms of completion and prompt tokens per row; None without committed data."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    data = committed_shards(out_dir, "data")
    if not data:
        return None
    table = pq.read_table(data, columns=["num_completion_tokens", "num_prompt_tokens"])
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    completion, prompt = fig.subplots(1, 2)
    for ax, column, color in ((completion, "num_completion_tokens", "tab:blue"),
                              (prompt, "num_prompt_tokens", "tab:gray")):
        values = table[column].to_numpy()
        ax.hist(values, bins=_token_bins(values), color=color, edgecolor="white", linewidth=0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    completion.set_title("completion length")
    prompt.set_title("prompt length")
    for ax in (completion, prompt):
        ax.set_xlabel("tokens")
        ax.set_ylabel("rows")
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    return path

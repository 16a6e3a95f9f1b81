"""`batchgen export OUT --format openai|jsonl|parquet --to FILE [--errors FILE]`: a job's output as one file.

- `parquet`: every committed completion row in one file; `jsonl`: the same rows, one flat JSON object a line.
- `openai`: one line per input row in the shape of OpenAI's batch output (`{id, custom_id, response: {status_code,
  request_id, body: {id, object, created, model, choices, usage}}, error}`), its samples as `choices`; rejected
  rows become error lines `{id, custom_id, response: null, error: {code, message}}`, in `--errors` when given,
  else in the same file. Every input row that is committed appears exactly once across the two files.

Order: the source's. Rows keyed by position (`row_idx`) sort by it; with a `key_column` the source named in the
output's job.resolved.yaml is read again to learn each key's position; if it cannot be read, rows keep commit
order and the result says so. Only committed shards count (a crash's leftovers are not read), and each is checked against its record before
anything is written: size, SHA-256, row count, keys (output/shard_check.py); a damaged output, or one where a row
key is in two records, stops the export naming the file (exit 2), so no row is ever exported twice or short.

`--to` and `--errors` must name two different files (not folders), outside the output and the job's source; each
is refused otherwise (exit 2) before anything is written. A file is written under a temporary name and renamed
when whole (both files written before either is renamed); an export that fails leaves no temporary file behind.

JSON has no NaN or Infinity: in `jsonl` and `openai` exports a float that is NaN, Infinity or -Infinity (a kept
input column, a logprob of -inf) is written as null. `parquet` keeps them as they are.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from batchgen.errors import JobError
from batchgen.output import manifest as mf
from batchgen.output.layout import refuse_pending_fresh, resolved_job_path
from batchgen.output.ledger import Ledger
from batchgen.output.shard_check import read_checked
from batchgen.output.temp_file import removed_on_failure

FORMATS = ("openai", "jsonl", "parquet")
OPENAI_FINISH = {"stop": "stop", "stop_string": "stop", "length": "length"}


@dataclass
class ExportResult:
    num_rows: int = 0  # lines (openai) or rows (jsonl, parquet) written to `to`
    num_errors: int = 0  # error lines (openai)
    order: str = "source"  # or "commit" when the source could not be read
    notes: list[str] = field(default_factory=list)


def _committed(ledger: Ledger, folder: str) -> list[tuple[pa.Table, float]]:
    """Every committed shard of `folder`, read and checked against its record, with its commit time."""
    return [(read_checked(ledger.out_dir, e, i, folder), e.record.get("time", 0.0))
            for i, e in enumerate(ledger.entries) if e.record.get(folder)]


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinite float (nested in lists and dicts too) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def _json(obj: Any) -> str:
    """One line of valid JSON: NaN and +-Infinity become null (JSON has neither)."""
    try:
        return json.dumps(obj, ensure_ascii=False, default=str, allow_nan=False)
    except ValueError:  # only when a non-finite float is in there: the cost is paid by those rows alone
        return json.dumps(_finite(obj), ensure_ascii=False, default=str, allow_nan=False)


def _spec(out_dir: Path):
    from batchgen.config import JobSpec

    path = resolved_job_path(out_dir)
    if not path.is_file():
        raise JobError(f"{out_dir} has no job.resolved.yaml: not a batchgen output directory, or never run")
    return JobSpec.model_validate(yaml.safe_load(path.read_text()))


def _positions(spec, key_name: str, keys: set, result: ExportResult, open_source) -> dict | None:
    """key -> source position, or None (commit order) when the source cannot be read again."""
    if key_name == "row_idx" and spec.source.key_column is None:
        return None  # the key is the position
    if open_source is None:
        result.order = "commit"
        return None

    try:
        positions = {}
        source = open_source(spec.source)
        source.quiet = True  # its notices were the run's (an OpenAI file's ignored body.model)
        for row in source:
            if row.columns is not None:
                key = row.columns.get(spec.source.key_column)
                if key in keys and key not in positions:
                    positions[key] = row.position
    except (JobError, OSError) as e:
        result.order = "commit"
        result.notes.append(f"the source could not be read again ({e}): rows are in commit order")
        return None
    return positions


def _sorted_data(ledger: Ledger, spec, result: ExportResult, open_source) -> tuple[pa.Table | None, str, np.ndarray]:
    """All committed data rows in source order, the key column's name, and each row's commit time."""
    shards = _committed(ledger, "data")
    if not shards:
        return None, "", np.zeros(0)
    table = pa.concat_tables([t for t, _ in shards], promote_options="permissive")
    times = np.concatenate([np.full(t.num_rows, when) for t, when in shards])
    key_name = table.schema.names[0]
    keys = table[key_name].to_pylist()
    positions = _positions(spec, key_name, set(keys), result, open_source)
    commit_index = np.arange(len(keys))
    if positions is not None:
        # a key the source no longer holds (edited since the run) goes last, in commit order
        pos = np.array([positions.get(k, len(keys) + 1 << 40) for k in keys], dtype=np.int64)
        missing = len({k for k in keys if k not in positions})
        if missing:
            result.notes.append(f"{missing} keys are no longer in the source: their rows come last, in commit "
                                f"order")
    else:  # keyed by position, or commit order when the source could not be read
        pos = np.array(keys, dtype=np.int64) if result.order == "source" else commit_index
    order = np.lexsort((table["sample_idx"].to_numpy(), commit_index, pos))  # position, commit, sample
    return table.take(order), key_name, times[order]


def _rejects(ledger: Ledger) -> list[tuple[str, dict]]:
    """(key as text, reject row) of every committed reject, in source order."""
    rows = []
    for table, _ in _committed(ledger, "rejects"):
        key_name = table.schema.names[0]  # the key column, stored as text in rejects
        rows += [(r[key_name], r) for r in table.to_pylist()]
    return sorted(rows, key=lambda kr: kr[1]["row_position"])


def _digest(key: Any) -> str:
    return hashlib.sha1(json.dumps(key, default=str).encode()).hexdigest()[:24]


def _openai_lines(table: pa.Table, key_name: str, times: np.ndarray, spec) -> list[str]:
    chat = spec.prompt.chat
    model = spec.model.path or "batchgen"
    rows = table.to_pylist()
    lines, i = [], 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j][key_name] == rows[i][key_name]:
            j += 1
        samples, key, h = rows[i:j], rows[i][key_name], _digest(rows[i][key_name])
        choices = [{"index": s["sample_idx"], **({"message": {"role": "assistant", "content": s["completion"]}}
                                                  if chat else {"text": s["completion"]}),
                    "finish_reason": OPENAI_FINISH.get(s["finish_reason"], s["finish_reason"]), "logprobs": None}
                   for s in samples]
        completion = sum(s["num_completion_tokens"] for s in samples)
        prompt = samples[0]["num_prompt_tokens"]
        body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{h}", "object": "chat.completion" if chat else
                "text_completion", "created": int(times[i]), "model": model, "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}
        lines.append(_json({"id": f"batch_req_{h}", "custom_id": str(key), "response": {
            "status_code": 200, "request_id": f"req_{h}", "body": body}, "error": None}))
        i = j
    return lines


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _write_all(files: list[tuple[Path, Any]]) -> None:
    """Write each (path, write) whole: `write(tmp)` fills a temporary file next to `path`, and only when every
    one is written are they renamed over their paths. On any failure (a full disk, a rename onto a folder, Ctrl-C)
    every temporary file is removed and the error raised: a failed export leaves no hidden copy behind, and one
    that fails while writing `--errors` has not replaced `--to` either."""
    with contextlib.ExitStack() as stack:
        tmps = [stack.enter_context(removed_on_failure(_tmp(path), path)) for path, _ in files]
        for tmp, (_, write) in zip(tmps, files):
            write(tmp)
        for tmp, (path, _) in zip(tmps, files):
            os.replace(tmp, path)


def _lines_writer(lines: list[str]):
    def write(tmp: Path) -> None:
        with open(tmp, "w") as f:
            for line in lines:
                f.write(line + "\n")
    return write


def _refuse_same_file(to: Path, errors: Path | None) -> None:
    """JobError when --to and --errors name one file (the same path, another spelling of it, or a symbolic link
    to it): the error lines would replace the results."""
    if errors is None:
        return
    if to.expanduser().resolve() == errors.expanduser().resolve() or _same_existing_file(to, errors):
        raise JobError(f"--to {to} and --errors {errors} name the same file: the error lines would replace the "
                       f"results. Give --errors another file, or leave --errors out to put the error lines into "
                       f"--to")


def _same_existing_file(a: Path, b: Path) -> bool:
    """Both exist and are one file (a hard link; two spellings on a case-insensitive file system)."""
    try:
        return os.path.samefile(a.expanduser(), b.expanduser())
    except OSError:  # one of them does not exist yet: resolve() compared the paths
        return False


def _refuse_destination(option: str, dest: Path, out_dir: Path, spec) -> None:
    """JobError when an export would write over what it reads: a file inside the output (its own shards,
    manifests) or the job's source (a file it names, or a file inside a folder it names), or cannot write at all:
    `dest` is a folder, or its folder does not exist."""
    if dest.expanduser().is_dir():
        raise JobError(f"{option} {dest} is a folder: name the file to write, not a folder")
    if not dest.expanduser().parent.is_dir():
        raise JobError(f"{option} {dest}: the folder {dest.expanduser().parent} does not exist: create it, or name a "
                       f"file in a folder that exists")
    dest = dest.expanduser().resolve()
    if dest.is_relative_to(out_dir.resolve()):
        raise JobError(f"{option} {dest} lies inside the output {out_dir}, whose files export reads: write it "
                       f"elsewhere")
    paths = spec.source.path if isinstance(spec.source.path, list) else [spec.source.path]
    for pattern in paths:
        matches = [Path(m).resolve() for m in glob.glob(str(Path(pattern).expanduser()), recursive=True)]
        for source in matches:
            if dest == source or (source.is_dir() and dest.is_relative_to(source)):
                raise JobError(f"{option} {dest} would write over or into the job's source ({pattern}): write it "
                               f"elsewhere")


def export(out_dir: Path, fmt: str, to: Path, errors: Path | None = None, open_source=None) -> ExportResult:
    """`open_source` (sources.open_source, given by the caller: output/ sits below sources/) reads the job's source
    again for the rows' source order; None: commit order."""
    out_dir, to = Path(out_dir), Path(to).expanduser()  # the checks below and the write name the same file
    errors = Path(errors).expanduser() if errors is not None else None
    if fmt not in FORMATS:
        raise JobError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    if errors is not None and fmt != "openai":
        raise JobError("--errors is for --format openai (the other formats hold completion rows only)")
    if not (out_dir / mf.MANIFEST_DIR).is_dir():
        raise JobError(f"{out_dir} is not a batchgen output directory (it has no manifest/ folder)")
    _refuse_same_file(to, errors)  # before anything is read or written
    refuse_pending_fresh(out_dir)
    spec = _spec(out_dir)
    for option, dest in (("--to", to), ("--errors", errors)):
        if dest is not None:
            _refuse_destination(option, dest, out_dir, spec)
    result = ExportResult()
    ledger = mf.checked_ledger(out_dir)  # every record checked, no key in two records: each row exported once
    table, key_name, times = _sorted_data(ledger, spec, result, open_source)
    if fmt == "parquet":
        if table is None:
            raise JobError(f"{out_dir} has no committed completion rows to export")
        _write_all([(to, lambda tmp: pq.write_table(table, tmp))])
        result.num_rows = table.num_rows
        return result
    if fmt == "jsonl":
        rows = table.to_pylist() if table is not None else []
        _write_all([(to, _lines_writer([_json(r) for r in rows]))])
        result.num_rows = len(rows)
        return result
    lines = _openai_lines(table, key_name, times, spec) if table is not None else []
    error_lines = [_json({"id": f"batch_req_{_digest(key)}", "custom_id": str(key), "response": None,
                          "error": {"code": r["error_class"], "message": r["message"]}})
                   for key, r in _rejects(ledger)]
    result.num_rows, result.num_errors = len(lines), len(error_lines)
    if errors is None:
        _write_all([(to, _lines_writer(lines + error_lines))])
    else:
        _write_all([(to, _lines_writer(lines)), (errors, _lines_writer(error_lines))])
    return result

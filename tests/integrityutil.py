"""Helpers for the output-integrity tests: one reference output of a tiny job (data and rejects shards), copies of
it to damage, and the CLI in-process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows, seed_rows, write_job

NUM_ROWS = 11  # and one malformed line: a rejects shard too

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, [*args, "--no-progress"] if args[0] == "run" else list(args))


def make_reference(tmp: Path, model_dir: str) -> tuple[Path, Path]:
    """(job file, finished output) of a seeded job: 11 rows x 2 samples in shards of 3 rows, one reject."""
    lines = [json.dumps(r) for r in seed_rows(NUM_ROWS)]
    lines.insert(4, "{not json")
    (tmp / "rows.jsonl").write_text("\n".join(lines) + "\n")
    job = write_job(tmp, model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"temperature": 0.9, "n": 2, "max_new_tokens": 6}, engine={"max_num_seqs": 4},
                    output={"rows_per_shard": 3, "report": False})
    out = tmp / "reference"
    done = cli("run", str(job), "-o", str(out))
    assert done.exit_code == 0, done.output
    assert list((out / "rejects").glob("*.parquet")), "the reference has a rejects shard"
    return job, out


def copy_output(reference: Path, to: Path) -> Path:
    shutil.copytree(reference, to, ignore=shutil.ignore_patterns(".lock-*"))
    return to


def content(out: Path) -> list[tuple]:
    """(key, sample, completion) of every data row, sorted; and that no row is there twice."""
    rows = [(r["id"], r["sample_idx"], r["completion"]) for r in read_rows(out)]
    assert len(rows) == len(set(rows)), "a row is in the output twice"
    return sorted(rows)


def reject_keys(out: Path) -> list[str]:
    return sorted(r["id"] for r in read_rows(out, "rejects"))


def manifest_lines(out: Path, tag: str = "w00000") -> list[bytes]:
    return (out / "manifest" / f"{tag}.jsonl").read_bytes().split(b"\n")[:-1]


def write_manifest(out: Path, lines: list[bytes], tag: str = "w00000", end: bytes = b"\n") -> None:
    (out / "manifest" / f"{tag}.jsonl").write_bytes(b"\n".join(lines) + end)


def listing(out: Path) -> set[str]:
    return {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}

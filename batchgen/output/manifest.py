"""The commit protocol's ledger: one append-only JSONL manifest per worker.

A row is done iff its key is in a manifest line. A shard becomes visible as `data/*.parquet` by an
atomic rename after fsync, and is recorded here afterwards; a crash between the two leaves an orphan
shard that no manifest names, which `remove_orphans` deletes before the next run generates its rows
again. A crash during the append leaves a torn last line, which is ignored and cut off on reopen.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchgen.output import faults

MANIFEST_DIR = "manifest"
SHARD_DIRS = ("data", "rejects")


def worker_tag(worker_index: int) -> str:
    return f"w{worker_index:05d}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_lines(path: Path) -> tuple[list[dict], int]:
    """Complete records and the byte length of the good prefix (a torn tail is not part of it)."""
    data = path.read_bytes()
    records, good = [], 0
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            break  # torn append: the commit did not happen
        try:
            records.append(json.loads(raw))
        except json.JSONDecodeError:
            break
        good += len(raw)
    return records, good


def read_all(out_dir: Path) -> Iterator[tuple[str, dict]]:
    """(worker tag, commit record) for every committed shard of every worker."""
    mdir = out_dir / MANIFEST_DIR
    if not mdir.is_dir():
        return
    for path in sorted(mdir.glob("w*.jsonl")):
        records, _ = _read_lines(path)
        for r in records:
            yield path.stem, r


class Manifest:
    """This worker's manifest, opened for appending."""

    def __init__(self, out_dir: Path, worker_index: int) -> None:
        self.out_dir = out_dir
        self.tag = worker_tag(worker_index)
        self.path = out_dir / MANIFEST_DIR / f"{self.tag}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records: list[dict] = []
        if self.path.exists():
            records, good = _read_lines(self.path)
            if good != self.path.stat().st_size:
                with open(self.path, "r+b") as f:  # cut the torn tail so appends start on a line boundary
                    f.truncate(good)
                    os.fsync(f.fileno())
        self.next_commit = 1 + max((r["commit"] for r in records), default=-1)

    def append(self, record: dict[str, Any]) -> None:
        """Durably record a commit. Only after this returns are the record's rows done."""
        line = (json.dumps({"commit": self.next_commit, **record}, separators=(",", ":")) + "\n").encode()
        with open(self.path, "ab") as f:
            if faults.armed("manifest_torn"):  # crash test: half a line reaches the disk
                f.write(line[: len(line) // 2])
                f.flush()
                os.fsync(f.fileno())
                faults.die()
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.next_commit += 1


def committed_shards(out_dir: Path, folder: str) -> list[Path]:
    """The shards of `folder` ("data" or "rejects") that manifests record: worker by worker, in commit order."""
    return [out_dir / r[folder] for _, r in read_all(out_dir) if r.get(folder)]


def committed_files(out_dir: Path) -> set[str]:
    names = set()
    for _, r in read_all(out_dir):
        for d in SHARD_DIRS:
            if r.get(d):
                names.add(r[d])
    return names


def remove_orphans(out_dir: Path, owned_tags: set[str] | None) -> list[str]:
    """Delete shards (and temp files) no manifest records. `owned_tags`: only those workers' files
    (None: every worker's). Returns the relative paths removed."""
    committed = committed_files(out_dir)
    removed = []
    for d in SHARD_DIRS:
        folder = out_dir / d
        if not folder.is_dir():
            continue
        for f in folder.iterdir():
            rel = f"{d}/{f.name}"
            tag = f.name.lstrip(".").split("-")[1] if f.name.lstrip(".").startswith("part-") else None
            if rel in committed or (owned_tags is not None and tag not in owned_tags):
                continue
            f.unlink()
            removed.append(rel)
    return removed

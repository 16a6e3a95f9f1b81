"""The commit protocol's ledger: one append-only JSONL manifest per worker.

A row is done iff its key is in a committed manifest record. A shard becomes visible as `data/*.parquet` by an
atomic rename after fsync, and is recorded here afterwards, with its size and SHA-256 (manifest_line.py: each line
also carries a checksum of itself). A crash between the two leaves an orphan shard that no manifest names, which
the worker's next run deletes before it generates those rows again. A crash during the append leaves a torn last
line, which is not committed and is cut off on reopen. Anything else that does not check out is damage: every
reader stops (OutputDamaged, exit 2) and nothing is deleted (ledger.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from batchgen.output import faults
from batchgen.output.damage import OutputDamaged
from batchgen.output.keyset import KeySet
from batchgen.output.ledger import MANIFEST_DIR, SHARD_DIRS, Ledger, read_ledger  # noqa: F401 (SHARD_DIRS: re-exported)
from batchgen.output.manifest_line import encode, read_file


def worker_tag(worker_index: int) -> str:
    return f"w{worker_index:05d}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_all(out_dir: Path) -> Iterator[tuple[str, dict]]:
    """(worker tag, commit record) for every committed shard of every worker; OutputDamaged if anything named
    does not check out (ledger.py)."""
    ledger = read_ledger(out_dir)
    ledger.raise_if_damaged()
    for e in ledger.entries:
        yield e.tag, e.record


class Manifest:
    """This worker's manifest, opened for appending."""

    def __init__(self, out_dir: Path, worker_index: int) -> None:
        self.out_dir = out_dir
        self.tag = worker_tag(worker_index)
        self.path = out_dir / MANIFEST_DIR / f"{self.tag}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.next_commit = 0
        if self.path.exists():
            mfile = read_file(self.path, f"{MANIFEST_DIR}/{self.path.name}")
            if mfile.problems:  # never append after damage: `repair` decides what it was
                raise OutputDamaged(out_dir, mfile.problems)
            if mfile.tail:
                with open(self.path, "r+b") as f:
                    if mfile.tail == "torn":  # cut it so appends start on a line boundary
                        f.truncate(mfile.good_bytes)
                    else:  # a whole record that lost only its newline: it is committed, end its line
                        f.seek(0, 2)
                        f.write(b"\n")
                    os.fsync(f.fileno())
            self.next_commit = mfile.max_commit + 1

    def append(self, record: dict[str, Any]) -> None:
        """Durably record a commit. Only after this returns are the record's rows done."""
        line = encode({"commit": self.next_commit, **record})
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
    return [path for path, _ in checked_ledger(out_dir).shards(folder)]


def committed_files(out_dir: Path) -> set[str]:
    return checked_ledger(out_dir).named()


def checked_ledger(out_dir: Path) -> Ledger:
    """The ledger (ledger.py), or OutputDamaged naming what does not check out."""
    ledger = read_ledger(out_dir)
    ledger.raise_if_damaged()
    return ledger


def remove_orphans(out_dir: Path, owned_tags: set[str] | None, ledger: Ledger | None = None) -> list[str]:
    """Delete what a crash of the `owned_tags` workers (None: every worker) left: their temporary shard files and
    the shard one past their last commit, which no record names (ledger.py). Nothing else: a foreign file, or a
    shard whose record was lost (then the ledger is damaged and this raises before deleting anything). Returns
    the relative paths removed."""
    ledger = ledger if ledger is not None else checked_ledger(out_dir)
    ledger.raise_if_damaged()
    removed = []
    for orphan in ledger.orphans:
        if orphan.kind in ("tmp", "leftover") and (owned_tags is None or orphan.tag in owned_tags):
            (out_dir / orphan.rel).unlink(missing_ok=True)
            removed.append(orphan.rel)
    return removed


def tags_from(ledger: Ledger, first_index: int) -> set[str]:
    """The worker tags of index >= first_index the output holds anything of: a manifest, or a crash's leftover or
    temporary shard (a worker killed in its first commit has no manifest yet, only the shard it was renaming)."""
    tags = set(ledger.manifests) | {o.tag for o in ledger.orphans if o.kind in ("tmp", "leftover")}
    return {t for t in tags if t is not None and int(t[1:]) >= first_index}


def prepare_resume(out_dir: Path, owned_tags: Callable[[Ledger], set[str]]) -> KeySet:
    """Before a worker generates: check every worker's records, delete what a crash of the owned workers left
    (`owned_tags`: their tags, given the checked ledger), and return every committed row key (the rows to skip).
    OutputDamaged, with nothing deleted, if damaged."""
    ledger = checked_ledger(out_dir)
    remove_orphans(out_dir, owned_tags(ledger), ledger)
    return ledger.keys

"""Ledger: every worker's committed records, read and checked together, and the shard files no record names.

Checked on every read (one stat per shard, one hash per key): each manifest line's checksum, each named shard's
existence and size, no shard named by two records, no row key in two records (of any workers), and committed shards
whose record is lost. Shards' content hashes are not read here, since a resume or a `status` over a large output
would read every byte: `verify` checks them, and so do the readers that read every byte anyway (export, a chained
job's source).

Orphans (shard files no record names) are one of:
- "tmp": `.part-wT-N.parquet.tmp`, a shard being written or a crash's; its worker deletes it on its next run;
- "leftover": `part-wT-N.parquet` with N one past worker T's last commit: a crash between the shard's rename and
  its record's append (the writer names shard N after the commit it is about to record), or one being committed
  right now; its worker deletes it on its next run and generates its rows again;
- "lost_record": any other `part-wT-N.parquet`: a committed shard whose record was lost (a line deleted, a
  manifest removed); damage;
- "foreign": not a name batchgen writes; never touched.
The folders are listed before the manifests are read: a shard renamed after the listing is not seen, and one
listed whose record is appended before the read is seen named, so a live worker's commit is never a lost record.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.output.damage import OutputDamaged, Problem
from batchgen.output.keyset import KeySet
from batchgen.output.manifest_line import SHARD_NAME, ManifestFile, read_file

MANIFEST_DIR = "manifest"
SHARD_DIRS = ("data", "rejects")
TMP_NAME = re.compile(r"\.part-(w\d{5})-(\d{6})\.parquet\.tmp")
MANIFEST_NAME = re.compile(r"w\d{5}\.jsonl")


@dataclass
class Entry:
    """One committed record and where it is."""

    tag: str  # the worker's, "w00000"
    rel: str  # its manifest, "manifest/w00000.jsonl"
    line: int
    record: dict[str, Any]
    checked: bool  # it carries checksums (written by a batchgen that records them)
    raw: bytes = b""  # the line as on disk, newline excluded

    def files(self) -> list[tuple[str, str, dict | None]]:
        """(folder, relative path, {"bytes", "sha256"} or None for a legacy record) of each shard it names."""
        meta = self.record.get("files") or {}
        return [(d, self.record[d], meta.get(self.record[d])) for d in SHARD_DIRS if self.record.get(d)]

    @property
    def where(self) -> str:
        return f"{self.rel} line {self.line}"


@dataclass
class Orphan:
    rel: str
    kind: str  # "tmp", "leftover", "lost_record" or "foreign" (see the module docstring)
    tag: str | None = None
    commit: int | None = None


@dataclass
class Ledger:
    out_dir: Path
    manifests: dict[str, ManifestFile] = field(default_factory=dict)  # by worker tag
    entries: list[Entry] = field(default_factory=list)  # worker by worker, line by line
    problems: list[Problem] = field(default_factory=list)
    orphans: list[Orphan] = field(default_factory=list)
    keys: KeySet = field(default_factory=KeySet)  # every committed row key
    num_keys: int = 0  # with repeats (== len(keys) when no key is in two records)

    def raise_if_damaged(self) -> None:
        if self.problems:
            raise OutputDamaged(self.out_dir, self.problems)

    def shards(self, folder: str) -> list[tuple[Path, Entry]]:
        return [(self.out_dir / e.record[folder], e) for e in self.entries if e.record.get(folder)]

    def named(self) -> set[str]:
        return {rel for e in self.entries for _, rel, _ in e.files()}


def _listing(out_dir: Path) -> list[tuple[str, str]]:
    """(folder, name) of every entry of data/ and rejects/."""
    out = []
    for d in SHARD_DIRS:
        try:
            out += [(d, name) for name in os.listdir(out_dir / d)]
        except FileNotFoundError:
            continue
    return out


def _check_duplicates(ledger: Ledger) -> None:
    owner: dict[str, int] = {}
    for i, e in enumerate(ledger.entries):
        for _, rel, _ in e.files():
            if rel in owner:
                first = ledger.entries[owner[rel]]
                ledger.problems.append(Problem(e.rel, e.line, f"names {rel}, which {first.where} names too (a "
                                                              f"duplicated record)", "duplicate", i))
            else:
                owner[rel] = i
    ledger.num_keys = sum(len(e.record["keys"]) for e in ledger.entries)
    ledger.keys = KeySet.from_keys(k for e in ledger.entries for k in e.record["keys"])
    if len(ledger.keys) == ledger.num_keys:
        return
    seen = KeySet()  # a second pass only when some key repeats: which records share keys
    for i, e in enumerate(ledger.entries):
        clashes: dict[int, list] = {}
        for k in e.record["keys"]:
            earlier = seen.add(k, i)
            if earlier is not None:
                clashes.setdefault(earlier, []).append(k)
        for j, ks in clashes.items():
            other = "itself" if j == i else ledger.entries[j].where
            ledger.problems.append(Problem(e.rel, e.line, f"{len(ks)} of its row keys (first {ks[0]!r}) are also in "
                                                          f"{other}: rows committed twice", "duplicate", i))


def _check_sizes(ledger: Ledger) -> None:
    for i, e in enumerate(ledger.entries):
        for _, rel, meta in e.files():
            try:
                size = os.stat(ledger.out_dir / rel).st_size
            except FileNotFoundError:
                ledger.problems.append(Problem(rel, None, f"missing; {e.where} committed its rows", "missing", i))
                continue
            if meta is not None and size != meta["bytes"]:
                ledger.problems.append(Problem(rel, None, f"{size} bytes, but {e.where} recorded {meta['bytes']} "
                                                          f"(truncated or overwritten)", "size", i))


def _classify_orphans(ledger: Ledger, listing: list[tuple[str, str]]) -> None:
    named = ledger.named()
    lost_manifests: set[str] = set()
    for folder, name in listing:
        rel = f"{folder}/{name}"
        if rel in named:
            continue
        if m := TMP_NAME.fullmatch(name):
            ledger.orphans.append(Orphan(rel, "tmp", m.group(1), int(m.group(2))))
            continue
        m = SHARD_NAME.fullmatch(rel)
        if m is None:
            ledger.orphans.append(Orphan(rel, "foreign"))
            continue
        tag, commit = m.group(2), int(m.group(3))
        mfile = ledger.manifests.get(tag)
        next_commit = mfile.max_commit + 1 if mfile is not None else 0
        if commit == next_commit:
            ledger.orphans.append(Orphan(rel, "leftover", tag, commit))
        else:
            ledger.orphans.append(Orphan(rel, "lost_record", tag, commit))
            ledger.problems.append(Problem(rel, None, f"a committed shard that no record names (worker {tag}'s "
                                                      f"records end at commit {next_commit - 1}): its record was "
                                                      f"lost", "lost_record"))
            if mfile is None and tag not in lost_manifests:  # shards of several commits, and no manifest at all
                lost_manifests.add(tag)
                ledger.problems.append(Problem(f"{MANIFEST_DIR}/{tag}.jsonl", None, f"missing, while committed "
                                                                               f"shards of worker {tag} are here",
                                               "lost_record"))


def read_ledger(out_dir: Path) -> Ledger:
    """Every committed record of `out_dir` and every problem found (see the module docstring); raises nothing."""
    out_dir = Path(out_dir)
    ledger = Ledger(out_dir)
    listing = _listing(out_dir)
    mdir = out_dir / MANIFEST_DIR
    paths = sorted(p for p in mdir.iterdir() if MANIFEST_NAME.fullmatch(p.name)) if mdir.is_dir() else []
    for path in paths:
        mfile = read_file(path, f"{MANIFEST_DIR}/{path.name}")
        ledger.manifests[path.stem] = mfile
        ledger.problems += mfile.problems
        ledger.entries += [Entry(path.stem, mfile.rel, ln.number, ln.record, ln.checked, ln.raw) for ln in mfile.lines]
    _check_duplicates(ledger)
    _check_sizes(ledger)
    _classify_orphans(ledger, listing)
    return ledger

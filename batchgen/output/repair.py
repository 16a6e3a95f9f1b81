"""`batchgen repair OUT`: rebuild what can be rebuilt after damage, like restic's or borg's repair; deletes nothing.

Holding every worker's lock (no run may write meanwhile), from a full verify (verify.py):
- a sound record stays as it was, byte for byte;
- a record whose shard is damaged (missing, truncated, changed, unreadable, short of rows) is rebuilt from its
  intact shard if it has one (a data shard and a rejects shard share a record), else dropped: the damaged shard's
  rows are no longer committed, so the next `batchgen run` generates them again;
- a record that repeats another's shard or keys (a line duplicated by hand, two runs over the same rows) is dropped;
  its own shards, if not the other's, are quarantined (their rows are committed once, by the first record);
- a shard no record names (its record line was damaged or lost, or a crash left it) becomes a record again when
  it reads back soundly and its keys are committed nowhere else: the keys come from the shard's own key column.
  When a damaged record line still holds the shard's size and SHA-256, they must match; else the shard's
  Parquet page checksums and schema are what vouch for it (said in the summary);
- the damaged files (and the manifests as they were) move to OUT/quarantine/<time>/, same relative paths.
Manifests are rewritten whole (temporary file, fsync, rename) before any shard moves: a crash in the middle
leaves damage that another `batchgen repair` finishes. Temporary files (`.part-*.tmp`) are left for the next run.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.output.layout import refuse_pending_fresh
from batchgen.output.keyset import KeySet
from batchgen.output.ledger import MANIFEST_DIR
from batchgen.output.lock import WorkerLock
from batchgen.output.manifest import fsync_dir
from batchgen.output.manifest_line import SHARD_NAME, encode
from batchgen.output.shard_rebuild import Rebuilder
from batchgen.output.verify import verify

QUARANTINE_DIR = "quarantine"
SALVAGE = re.compile(rb'"((?:data|rejects)/part-w\d{5}-\d{6}\.parquet)":\{"bytes":(\d+),"sha256":"([0-9a-f]{64})"\}')
RECORD_LEVEL = ("line",)  # problems of a manifest line itself (its shards become orphans)


@dataclass
class RepairResult:
    actions: list[str] = field(default_factory=list)
    quarantine: Path | None = None  # where damaged and replaced files were moved; None: none were
    rows_to_generate: bool = False  # rows were dropped with their damaged files: the next run generates them
    intact_after: bool = True
    summary_after: str = ""


def _tags(out_dir: Path) -> set[str]:
    tags = {p.stem for p in (out_dir / MANIFEST_DIR).glob("w*.jsonl")} if (out_dir / MANIFEST_DIR).is_dir() else set()
    tags |= {p.name.removeprefix(".lock-") for p in out_dir.glob(".lock-w*")}
    for folder in ("data", "rejects"):
        if (out_dir / folder).is_dir():
            tags |= {m.group(2) for f in os.listdir(out_dir / folder) if (m := SHARD_NAME.fullmatch(f"{folder}/{f}"))}
    return {t for t in tags if re.fullmatch(r"w\d{5}", t)}


def _write_manifest(path: Path, lines: list[bytes]) -> None:
    tmp = path.with_name(f".{path.name}.repair.tmp")
    with open(tmp, "wb") as f:
        f.write(b"".join(lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class _Repair:
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.v = verify(out_dir)
        self.ledger = self.v.ledger
        self.result = RepairResult()
        self.quarantine: set[str] = set()  # relative paths to move aside
        self.kept = KeySet()  # keys of the records the repaired manifests hold
        self.lines: dict[str, list[tuple[int, bytes]]] = {}  # tag -> (commit, line)
        salvaged = b"".join(raw for m in self.ledger.manifests.values() for raw in m.damaged_raw)
        self.salvaged = {m.group(1).decode(): {"bytes": int(m.group(2)), "sha256": m.group(3).decode()}
                         for m in SALVAGE.finditer(salvaged)}
        self.rebuilder = Rebuilder(out_dir, self.ledger)

    def say(self, text: str) -> None:
        self.result.actions.append(text)

    def keep(self, tag: str, raw: bytes | None, record: dict) -> bool:
        """Keep a record (its original line, or a rebuilt one) unless one of its keys is kept already."""
        if any(k in self.kept for k in record["keys"]):
            return False
        for k in record["keys"]:
            self.kept.add(k)
        line = raw + b"\n" if raw is not None else encode(record)
        self.lines.setdefault(tag, []).append((record["commit"], line))
        return True

    def records(self) -> None:
        damaged: dict[int, list] = {}
        for p in self.v.problems:
            if p.entry is not None and p.kind not in RECORD_LEVEL:
                damaged.setdefault(p.entry, []).append(p)
        named_by_kept: set[str] = set()
        for i, e in enumerate(self.ledger.entries):
            problems = damaged.get(i, [])
            if any(p.kind == "duplicate" for p in problems):
                own = [rel for _, rel, _ in e.files() if rel not in named_by_kept]
                self.quarantine |= {rel for rel in own if (self.out_dir / rel).exists()}
                self.say(f"dropped {e.where}: it repeats another record's shard or keys"
                         + (f"; its own shards quarantined: {', '.join(own)}" if own else ""))
                continue
            if not problems:
                if self.keep(e.tag, e.raw, e.record):
                    named_by_kept |= {rel for _, rel, _ in e.files()}
                    continue
            named = {rel for _, rel, _ in e.files()}
            bad = {p.file for p in problems if p.file in named}  # a record-level problem: rebuilt from all its shards
            sound = [(folder, rel) for folder, rel, _ in e.files() if rel not in bad]
            self.quarantine |= {rel for rel in bad if (self.out_dir / rel).is_file()}
            record = self.rebuilder.record(e.tag, e.record["commit"], sound) if sound else None
            if record is not None and self.keep(e.tag, None, record):
                named_by_kept |= set(rel for _, rel in sound)
                self.result.rows_to_generate |= len(e.record["keys"]) > len(record["keys"])
                self.say(f"rebuilt {e.where} from {', '.join(rel for _, rel in sound)}; "
                         f"{', '.join(sorted(bad)) or 'its key list'} damaged: "
                         f"{len(e.record['keys']) - len(record['keys'])} rows to generate again")
            else:
                self.quarantine |= {rel for _, rel in sound}
                self.result.rows_to_generate = True
                self.say(f"dropped {e.where}: {'; '.join(str(p) for p in problems)}; its "
                         f"{len(e.record['keys'])} rows will be generated again")

    def orphans(self) -> None:
        groups: dict[tuple[str, int], list[tuple[str, str]]] = {}
        for o in self.ledger.orphans:
            if o.kind in ("leftover", "lost_record") and o.rel not in self.quarantine:
                groups.setdefault((o.tag, o.commit), []).append((o.rel.split("/")[0], o.rel))
        for (tag, commit), files in sorted(groups.items()):
            names = ", ".join(rel for _, rel in files)
            why = self.rebuilder.unsound(files, self.salvaged)
            record = self.rebuilder.record(tag, commit, files) if why is None else None
            if record is None:
                self.quarantine |= {rel for _, rel in files}
                self.result.rows_to_generate = True
                self.say(f"quarantined {names}: {why or 'it cannot be read back'}; its rows will be generated again")
                continue
            if not self.keep(tag, None, record):
                self.quarantine |= {rel for _, rel in files}
                self.say(f"quarantined {names}: its rows are committed by another record")
                continue
            vouched = ("its size and SHA-256 as its damaged record line still holds them"
                       if all(rel in self.salvaged for _, rel in files) else
                       "its Parquet page checksums only (no record holds its SHA-256)")
            self.say(f"recorded {names} again (commit {commit} of {tag}, {len(record['keys'])} rows; checked "
                     f"against {vouched})")

    def write(self, stamp: str) -> None:
        qdir = self.out_dir / QUARANTINE_DIR / stamp
        mdir = self.out_dir / MANIFEST_DIR
        mdir.mkdir(exist_ok=True)
        tags = set(self.ledger.manifests) | set(self.lines)
        for tag in sorted(tags):
            path = mdir / f"{tag}.jsonl"
            lines = [line for _, line in sorted(self.lines.get(tag, []), key=lambda cl: cl[0])]
            if path.exists():
                (qdir / MANIFEST_DIR).mkdir(parents=True, exist_ok=True)
                if not lines:  # every record dropped: the manifest moves aside whole, no empty file stays
                    os.replace(path, qdir / MANIFEST_DIR / path.name)
                    fsync_dir(mdir)
                    continue
                shutil.copy2(path, qdir / MANIFEST_DIR / path.name)
            if lines:
                _write_manifest(path, lines)
        for rel in sorted(self.quarantine):
            (qdir / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.out_dir / rel, qdir / rel)
        self.result.quarantine = qdir if qdir.is_dir() else None  # nothing moved or replaced: nothing to name


def repair(out_dir: Path) -> RepairResult:
    out_dir = Path(out_dir)
    refuse_pending_fresh(out_dir)
    locks = []
    try:
        for tag in sorted(_tags(out_dir)):
            locks.append(WorkerLock(out_dir, tag))  # JobError naming the run that holds it
        job = _Repair(out_dir)
        if job.v.intact:
            job.result.actions.append("nothing to repair: the output is intact")
            job.result.summary_after = job.v.summary()
            return job.result
        job.records()
        job.orphans()
        job.write(time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
        after = verify(out_dir)
        job.result.intact_after, job.result.summary_after = after.intact, after.summary()
        return job.result
    finally:
        for lock in locks:
            lock.remove()  # repair leaves no lock file behind

"""`batchgen verify OUT`: check everything an output directory holds (SQLite's integrity_check, restic's check).

Checked: every manifest line (its checksum; records written before checksums existed are counted and said to be
unverifiable), every named shard (size, SHA-256, readable Parquet with its page checksums, row count, keys), each
record's keys against its shards' (data keys plus rejects keys must be exactly the record's), shards named by two
records, row keys in two records (any workers), and files no record names: a crash's leftovers and temporary files
(normal: the worker's next run deletes them), committed shards whose record was lost (damage), files batchgen did
not write (listed, never touched). Reads every shard once. Intact: exit 0; damaged: exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from batchgen.errors import JobError
from batchgen.output.layout import foreign_entries, refuse_pending_fresh
from batchgen.output.damage import Problem, what_to_do
from batchgen.output.ledger import MANIFEST_DIR, Ledger, read_ledger
from batchgen.output.shard_check import inspect, key_texts

FILE_LEVEL = ("missing", "size")  # found by the ledger already: not read again


@dataclass
class Verification:
    out_dir: Path
    ledger: Ledger
    problems: list[Problem] = field(default_factory=list)
    num_shards: int = 0  # shard files checked in full
    num_bytes: int = 0

    @property
    def intact(self) -> bool:
        return not self.problems

    def orphans(self, kind: str) -> list[str]:
        return [o.rel for o in self.ledger.orphans if o.kind == kind]

    def summary(self) -> str:
        ledger, out_dir = self.ledger, self.out_dir
        entries = ledger.entries
        unchecked = sum(not e.checked for e in entries)
        lines = [f"{out_dir}: {'intact' if self.intact else f'DAMAGED ({len(self.problems)} problems)'}",
                 f"  records: {len(entries)} in {len(ledger.manifests)} manifest file(s), {ledger.num_keys} input "
                 f"rows committed"]
        if unchecked:
            lines.append(f"  {unchecked} records were written before manifests carried checksums: damage inside "
                         f"them cannot be detected (their shards' rows and keys were still checked)")
        lines.append(f"  shards: {self.num_shards} checked in full ({self.num_bytes / 1e3:,.0f} kB): size, SHA-256, "
                     f"Parquet pages, row count, keys")
        for tag, mfile in sorted(ledger.manifests.items()):
            if mfile.tail == "torn":
                lines.append(f"  {mfile.rel} ends in a torn line (a crash during a commit; not committed): worker "
                             f"{tag}'s next run cuts it")
        leftovers = self.orphans("leftover") + self.orphans("tmp")
        if leftovers:
            # with damage, a leftover may be the shard of a damaged record: repair decides, not the next run
            fate = ("the worker's next run deletes them" if self.intact else
                    "or shards of a damaged record: `repair` records those it can rebuild a record for, and the "
                    "next run after it deletes the rest")
            lines.append(f"  {len(leftovers)} uncommitted files a crash (or a commit under way) left: "
                         f"{', '.join(leftovers[:5])}{' ...' if len(leftovers) > 5 else ''}; {fate}")
        # the shard folders' strays (the ledger's) and anything else in the folder batchgen did not write
        listed = foreign_entries(out_dir)  # folders end in "/"
        foreign = sorted({*listed, *(o for o in self.orphans("foreign") if o not in listed and f"{o}/" not in listed)})
        if foreign:
            lines.append(f"  {len(foreign)} files batchgen did not write (never touched): {', '.join(foreign[:5])}"
                         f"{' ...' if len(foreign) > 5 else ''}")
        if self.problems:
            lines.append("problems:")
            lines += [f"  {p}" for p in self.problems]
            lines.append(what_to_do(out_dir, stopped=False))
        return "\n".join(lines)


def _check_record_keys(v: Verification, index: int, texts: set[str]) -> None:
    e = v.ledger.entries[index]
    listed = {str(k) for k in e.record["keys"]}
    if texts != listed:
        missing = sorted(listed - texts)
        extra = sorted(texts - listed)
        what = (f"{len(missing)} of its keys are in none of its shards (first {missing[0]!r})" if missing else
                f"its shards hold {len(extra)} keys it does not list (first {extra[0]!r})")
        v.problems.append(Problem(e.rel, e.line, what, "keys", index))


def verify(out_dir: Path) -> Verification:
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise JobError(f"{out_dir} does not exist")
    refuse_pending_fresh(out_dir)
    if not (out_dir / MANIFEST_DIR).is_dir() and not (out_dir / "data").is_dir():
        raise JobError(f"{out_dir} is not a batchgen output directory (it has no manifest/ or data/ folder)")
    ledger = read_ledger(out_dir)
    v = Verification(out_dir, ledger, list(ledger.problems))
    known = {p.file for p in ledger.problems if p.kind in FILE_LEVEL}
    for i, e in enumerate(ledger.entries):
        texts: set[str] = set()
        whole = True  # every shard of the record read and sound: its keys can be compared
        for folder, rel, _ in e.files():
            if rel in known:
                whole = False
                continue
            table, bad = inspect(out_dir, e, i, folder)
            v.num_shards += 1
            v.num_bytes += (out_dir / rel).stat().st_size if (out_dir / rel).exists() else 0
            if bad is not None:
                v.problems.append(bad)
                whole = False
                continue
            texts |= key_texts(table)
        if whole:
            _check_record_keys(v, i, texts)
    return v

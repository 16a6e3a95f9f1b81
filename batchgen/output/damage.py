"""Damage: what is wrong with an output directory's files, and the error that stops a command over it.

Damage is never repaired silently: a reader that finds a Problem stops with OutputDamaged (a JobError: exit 2)
naming the file (and manifest line) and pointing at `batchgen verify` / `batchgen repair`. Nothing is deleted
or regenerated on the way out, so the user can still decide what to do with the damaged files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.errors import JobError

MAX_PROBLEMS_NAMED = 3  # in an error message; `batchgen verify` lists them all
# what to do about a damaged fingerprint.json: it is what a resume is compared with, so it is not rewritten silently
FINGERPRINT_FIX = ("restore it from a backup; or, if you are sure the job file still holds the settings this output "
                   "was made with, delete it (the next run records the current settings); or start over with --fresh")


@dataclass(frozen=True)
class Problem:
    file: str  # relative to the output directory, e.g. "manifest/w00000.jsonl" or "data/part-w00000-000003.parquet"
    line: int | None  # 1-based manifest line, when the problem is a manifest line
    what: str
    # "line" (a damaged manifest line), "duplicate" (a record naming a file or keys another record holds),
    # "missing", "size", "hash", "rows", "keys", "unreadable" (a shard named by a record), "lost_record"
    # (a committed shard no record names)
    kind: str
    entry: int | None = None  # index into Ledger.entries of the record concerned, when there is one

    def __str__(self) -> str:
        where = f"{self.file} line {self.line}" if self.line is not None else self.file
        return f"{where}: {self.what}"


def what_to_do(out_dir: Path, stopped: bool = True) -> str:
    first = (f"Nothing was deleted or regenerated. Run `batchgen verify {out_dir}` to list all damage, then "
             if stopped else "Run ")
    return (f"{first}`batchgen repair {out_dir}`: it rebuilds the records it can from intact shards, moves damaged "
            f"files into {out_dir}/quarantine/ (it deletes nothing) and leaves the rows it cannot recover for "
            f"the next `batchgen run` to generate again.")


class OutputDamaged(JobError):
    """The output directory's committed files are damaged; exit 2, naming them."""

    def __init__(self, out_dir: Path, problems: list[Problem]) -> None:
        self.out_dir, self.problems = out_dir, problems
        named = "; ".join(str(p) for p in problems[:MAX_PROBLEMS_NAMED])
        more = f" (and {len(problems) - MAX_PROBLEMS_NAMED} more)" if len(problems) > MAX_PROBLEMS_NAMED else ""
        super().__init__(f"the output in {out_dir} is damaged: {named}{more}. {what_to_do(out_dir)}")


def load_json(path: Path, fix: str) -> Any:
    """A JSON file batchgen wrote; unreadable or not JSON (a NUL block after a power loss, an edit) is a JobError
    naming the file and `fix`, what the user can do about it."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise JobError(f"cannot read {path}: {e.strerror or e}; {fix}") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise JobError(f"{path} is damaged (not valid JSON: {str(e).splitlines()[0][:120]}); {fix}") from None

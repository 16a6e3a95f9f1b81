"""ManifestLine: one commit record as bytes on disk, with a checksum of itself, and the reading of a manifest file.

A line is ASCII JSON ending `,"check":"<32 hex>"}` + newline: the first 128 bits of the SHA-256 of the line's bytes
before that member, with `}` in its place (the record serialised without `check`). The checksum is over raw bytes,
so verifying never depends on how JSON re-serialises a float or a key. Each record also names its files with their
sizes and SHA-256 (`files`), computed once from the bytes the shard writer wrote.

Records written before checksums have no `check` and only LEGACY_FIELDS: they are read and counted as unchecked. A
checksummed record whose `check` member was damaged still has fields a legacy one never had (`files`), so it is
damage, not legacy.

Torn tail versus damage: an append writes a whole line in one write and fsyncs before the next append, so every
complete line (ending in a newline) was durable once; a complete line that does not decode is damage. Only the bytes
after the last newline can be an append cut short (kill -9, or a power loss, which leaves NULs): they are "torn",
not committed. A tail that is a whole checksummed record lacking only its newline is committed (its shard was
durable before the append began); a tail holding a verified record followed by other bytes is damage.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.output.damage import Problem

CHECK_MARK = b',"check":"'
CHECK_HEX = 32
LINE_END = b'"}'
LEGACY_FIELDS = frozenset({"commit", "data", "rejects", "num_rows", "num_samples", "num_rejects",
                           "num_prompt_tokens", "num_completion_tokens", "time", "keys"})
SHARD_NAME = re.compile(r"(data|rejects)/part-(w\d{5})-(\d{6})\.parquet")


class LineDamage(ValueError):
    """Why a complete manifest line is not a valid record."""


def _digest(body: bytes) -> bytes:
    return hashlib.sha256(body).hexdigest()[:CHECK_HEX].encode()


def encode(record: dict[str, Any]) -> bytes:
    """The record as one manifest line, newline included."""
    body = json.dumps(record, separators=(",", ":")).encode()  # ensure_ascii: any non-ASCII byte is damage
    return body[:-1] + CHECK_MARK + _digest(body) + LINE_END + b"\n"


def _parse(body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("ascii")
    except UnicodeDecodeError:
        nul = body.count(0)
        raise LineDamage(f"it holds {'NUL' if nul else 'non-text'} bytes (a block lost in a crash or power loss, "
                         f"or an edit)") from None
    try:
        record = json.loads(text)
    except ValueError as e:
        raise LineDamage(f"it is not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise LineDamage("it is not a JSON object")
    return record


def _check_fields(record: dict[str, Any], checked: bool) -> None:
    if not isinstance(record.get("keys"), list):
        raise LineDamage("it has no `keys` list (which rows it committed is unknown)")
    if not isinstance(record.get("commit"), int):
        raise LineDamage("it has no integer `commit` number")
    if checked and record.get("num_rows") != len(record["keys"]):
        raise LineDamage(f"it says num_rows {record['num_rows']} but lists {len(record['keys'])} keys")
    files = record.get("files") if checked else None
    for folder in ("data", "rejects"):
        name = record.get(folder)
        if name is None:
            continue
        if not isinstance(name, str) or not SHARD_NAME.fullmatch(name) or not name.startswith(folder + "/"):
            raise LineDamage(f"its `{folder}` is not a shard name of batchgen's: {name!r}")
        if checked:
            meta = files.get(name) if isinstance(files, dict) else None
            if not (isinstance(meta, dict) and isinstance(meta.get("bytes"), int)
                    and isinstance(meta.get("sha256"), str)):
                raise LineDamage(f"it has no size and checksum for {name}")


def decode(raw: bytes) -> tuple[dict[str, Any], bool]:
    """A complete line (without its newline) -> (record, checked); LineDamage if it is not a valid record."""
    at = raw.rfind(CHECK_MARK)
    if at >= 0:
        body = raw[:at] + b"}"
        tail = raw[at + len(CHECK_MARK):]
        if tail != _digest(body) + LINE_END:
            raise LineDamage("its checksum does not match its bytes (it was changed after it was written)")
        record = _parse(body)
        _check_fields(record, True)
        return record, True
    record = _parse(raw)
    if set(record) - LEGACY_FIELDS:
        raise LineDamage("its checksum is missing (the line was damaged where it held `check`)")
    _check_fields(record, False)
    return record, False


def _tail_state(raw: bytes) -> str:
    """Bytes after the last newline: "record" (a whole checksummed record, committed), "torn" (an append cut
    short: not committed) or "damaged" (a verified record followed by other bytes)."""
    at = raw.rfind(CHECK_MARK)
    if at < 0:
        return "torn"
    digest_end = at + len(CHECK_MARK) + CHECK_HEX
    if raw[at + len(CHECK_MARK):digest_end] != _digest(raw[:at] + b"}"):
        return "torn"
    rest = raw[digest_end:]
    if rest == LINE_END:
        return "record"
    return "torn" if LINE_END.startswith(rest) else "damaged"


@dataclass
class Line:
    number: int  # 1-based
    record: dict[str, Any]
    checked: bool
    raw: bytes  # the line's bytes, newline excluded


@dataclass
class ManifestFile:
    """One worker's manifest as read: committed records, damaged lines, and its tail."""

    path: Path
    rel: str  # "manifest/w00000.jsonl"
    lines: list[Line] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    damaged_raw: list[bytes] = field(default_factory=list)  # damaged lines' bytes (repair salvages checksums)
    good_bytes: int = 0  # length of the prefix of complete lines (plus an unterminated record)
    tail: str = ""  # "" (ends on a newline), "torn" or "record" (committed, its newline missing)

    @property
    def max_commit(self) -> int:
        return max((ln.record["commit"] for ln in self.lines), default=-1)


def read_file(path: Path, rel: str) -> ManifestFile:
    """Read a manifest as bytes, one line at a time: no line can make decoding fail for the others."""
    data = path.read_bytes()
    mfile = ManifestFile(path, rel)
    *complete, tail = data.split(b"\n")
    offset = 0
    for number, raw in enumerate(complete, 1):
        offset += len(raw) + 1
        try:
            record, checked = decode(raw)
        except LineDamage as e:
            mfile.problems.append(Problem(rel, number, f"damaged record: {e}", "line"))
            mfile.damaged_raw.append(raw)
            continue
        mfile.lines.append(Line(number, record, checked, raw))
    mfile.good_bytes = offset
    if tail:
        state = _tail_state(tail)
        number = len(complete) + 1
        if state == "record":
            try:
                record, checked = decode(tail)
            except LineDamage as e:
                mfile.problems.append(Problem(rel, number, f"damaged record: {e}", "line"))
                mfile.damaged_raw.append(tail)
                state = "damaged"
            else:
                mfile.lines.append(Line(number, record, checked, tail))
            mfile.good_bytes, mfile.tail = len(data), state
        elif state == "damaged":
            mfile.problems.append(Problem(rel, number, "damaged record: bytes follow its end (its newline was "
                                                       "overwritten)", "line"))
            mfile.damaged_raw.append(tail)
            mfile.good_bytes, mfile.tail = len(data), "damaged"
        else:
            mfile.tail = "torn"
    return mfile

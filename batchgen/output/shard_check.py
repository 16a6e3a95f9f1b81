"""ShardCheck: read a committed shard and check it against the record that names it.

A shard is read once, as bytes: its size and SHA-256 are compared with the record's (a legacy record has none),
then it is parsed from those bytes and its row count and keys compared with the record's. A reader that reads
every byte anyway (export, a chained job's source) pays only the hash (GB/s) for the full check."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.output.damage import OutputDamaged, Problem
from batchgen.output.ledger import Entry

ROW_COUNT_FIELD = {"data": "num_samples", "rejects": "num_rejects"}
HASH_CHUNK_BYTES = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def key_texts(table: pa.Table) -> set[str]:
    """The shard's row keys as text (its first column; rejects store keys as text)."""
    return {str(k) for k in table.column(0).to_pylist()}


def inspect(out_dir: Path, entry: Entry, index: int, folder: str) -> tuple[pa.Table | None, Problem | None]:
    """The shard `entry` names in `folder`, fully checked: (table, None), or (None or the table, the problem)."""
    rel = entry.record[folder]
    meta = (entry.record.get("files") or {}).get(rel)

    def problem(what: str, kind: str) -> Problem:
        return Problem(rel, None, f"{what} ({entry.where} committed it)", kind, index)

    # read into Arrow's own memory, not Python bytes: a Parquet reader thread may drop the last reference to a
    # buffer wrapping Python bytes after read_table returns, which needs the GIL; during interpreter shutdown that
    # aborted the process (exit 134 after `verify` or `export` had printed their result, ~1 run in 100; pyarrow
    # 26, apache/arrow#49942). An Arrow buffer's release needs no GIL.
    try:
        with pa.OSFile(str(out_dir / rel)) as f:
            data = f.read_buffer()
    except FileNotFoundError:
        return None, problem("missing", "missing")
    if meta is not None:
        if data.size != meta["bytes"]:
            return None, problem(f"{data.size} bytes, recorded {meta['bytes']} (truncated or overwritten)", "size")
        if hashlib.sha256(memoryview(data)).hexdigest() != meta["sha256"]:
            return None, problem("its bytes do not match its recorded SHA-256 (changed after it was written)",
                                 "hash")
    try:
        table = pq.read_table(pa.BufferReader(data), page_checksum_verification=True)
    except (pa.ArrowException, OSError, ValueError) as e:
        return None, problem(f"not a readable Parquet file ({str(e).splitlines()[0][:120]})", "unreadable")
    expected = entry.record.get(ROW_COUNT_FIELD[folder])
    if isinstance(expected, int) and table.num_rows != expected:
        return None, problem(f"{table.num_rows} rows, its record says {expected}", "rows")
    if table.num_columns == 0 or not key_texts(table) <= {str(k) for k in entry.record["keys"]}:
        return table, problem("holds row keys its record does not list", "keys")
    return table, None


def read_checked(out_dir: Path, entry: Entry, index: int, folder: str) -> pa.Table:
    """The shard's table, or OutputDamaged naming it."""
    table, bad = inspect(out_dir, entry, index, folder)
    if bad is not None:
        raise OutputDamaged(out_dir, [bad])
    return table

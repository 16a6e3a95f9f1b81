"""ShardWriter: buffers finished rows and commits them as Parquet shards with the manifest protocol.

Commit: write `.part-*.parquet.tmp`, fsync, rename to `part-*.parquet`, fsync the folder (data shard and
rejects shard), then append one manifest record naming both files with their sizes and SHA-256, and every row
key they hold. A row's samples always land in the same shard; a row is done only once its record is in the
manifest.

The shard is serialised into memory, hashed from those bytes and then written: the hash costs one pass over
bytes already in memory (SHA-256 runs at GB/s; a shard is MBs) and never reads the file back.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.output import arrow_columns, faults
from batchgen.output.manifest import Manifest, fsync_dir

# The key is stored as text in rejects: a row that could not be parsed has no key of the column's type.
REJECT_SCHEMA_FIELDS = [pa.field("row_position", pa.int64()), pa.field("error_class", pa.string()),
                        pa.field("message", pa.string())]


class ShardWriter:
    def __init__(self, out_dir: Path, manifest: Manifest, data_schema: pa.Schema, key_field: pa.Field,
                 rows_per_shard: int, commit_interval_s: float) -> None:
        self.out_dir = out_dir
        self.manifest = manifest
        self.data_schema = data_schema
        self.reject_schema = pa.schema([pa.field(key_field.name, pa.string()), *REJECT_SCHEMA_FIELDS])
        self.key_name = key_field.name
        self.rows_per_shard = rows_per_shard
        self.commit_interval_s = commit_interval_s
        for d in ("data", "rejects"):
            (out_dir / d).mkdir(parents=True, exist_ok=True)
        # One entry per finished input row, in finishing order: (key, its sample rows, its reject row or None).
        self._entries: list[tuple[Any, list[dict[str, Any]], dict[str, Any] | None]] = []
        self._num_generated = 0  # entries with sample rows
        self._last_commit = time.monotonic()
        self.failed = False  # a write failed: buffered rows stay uncommitted (the next run redoes them)

    @property
    def num_buffered_keys(self) -> int:
        return len(self._entries)

    def add_row(self, key: Any, sample_rows: list[dict[str, Any]]) -> None:
        """All samples of one input row (one output row each); they always land in the same shard."""
        self._entries.append((key, sample_rows, None))
        self._num_generated += 1

    def add_reject(self, key: Any, position: int, error_class: str, message: str) -> None:
        self._entries.append((key, [], {self.key_name: str(key), "row_position": position,
                                        "error_class": error_class, "message": message[:2000]}))

    def should_commit(self) -> bool:
        """A full shard is buffered, or the commit interval has passed with anything buffered."""
        if self._num_generated >= self.rows_per_shard:
            return True
        return bool(self._entries) and time.monotonic() - self._last_commit >= self.commit_interval_s

    def _write(self, folder: str, rows: list[dict], schema: pa.Schema) -> tuple[str, dict[str, Any]]:
        """Write one shard; its relative path and {"bytes", "sha256"} of what was written."""
        name = f"part-{self.manifest.tag}-{self.manifest.next_commit:06d}.parquet"
        final = self.out_dir / folder / name
        tmp = final.with_name(f".{name}.tmp")
        try:
            table = arrow_columns.table(rows, schema)
            sink = pa.BufferOutputStream()
            # page checksums: a reader (repair, over a shard whose record was lost) can tell a damaged page
            pq.write_table(table, sink, compression="zstd", write_page_checksum=True)
            shard = sink.getvalue()
            meta = {"bytes": shard.size, "sha256": hashlib.sha256(shard).hexdigest()}
            with open(tmp, "wb") as f:
                faults.raise_if_armed("shard_write", OSError(errno.ENOSPC, "No space left on device"))
                f.write(shard)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_dir(final.parent)
        except OSError as e:
            self.failed = True
            tmp.unlink(missing_ok=True)
            raise OSError(e.errno, f"cannot write shard in {final.parent}: {e.strerror or e}") from e
        return f"{folder}/{name}", meta

    def commit(self) -> int:
        """Make the oldest buffered rows durable and done: at most `rows_per_shard` generated rows (one data
        shard) plus the rejects among them. Returns how many input rows were committed (0: nothing buffered)."""
        if not self._entries:
            return 0
        faults.crash_if_armed("commit_start")
        taken, generated = 0, 0
        while taken < len(self._entries) and generated < self.rows_per_shard:
            generated += bool(self._entries[taken][1])
            taken += 1
        entries = self._entries[:taken]
        data = [r for _, rows, _ in entries for r in rows]
        rejects = [rej for _, _, rej in entries if rej is not None]
        record: dict[str, Any] = {"data": None, "rejects": None}
        files: dict[str, dict[str, Any]] = {}
        if data:
            record["data"], files[record["data"]] = self._write("data", data, self.data_schema)
        if rejects:
            record["rejects"], files[record["rejects"]] = self._write("rejects", rejects, self.reject_schema)
        faults.crash_if_armed("shard_renamed")
        record.update(num_rows=taken, num_samples=len(data), num_rejects=len(rejects),
                      num_prompt_tokens=sum(rows[0]["num_prompt_tokens"] for _, rows, _ in entries if rows),
                      num_completion_tokens=sum(r["num_completion_tokens"] for r in data),
                      time=time.time(), files=files, keys=[key for key, _, _ in entries])
        self.manifest.append(record)
        faults.crash_if_armed("commit_done")
        del self._entries[:taken]
        self._num_generated -= generated
        self._last_commit = time.monotonic()
        return taken

"""ShardWriter: buffers finished rows and commits them as Parquet shards with the manifest protocol.

Commit: write `.part-*.parquet.tmp`, fsync, rename to `part-*.parquet`, fsync the folder (data shard and
rejects shard), then append one manifest record naming both files and every row key they hold. A row's
samples always land in the same shard; a row is done only once its record is in the manifest.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.output import faults
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
        self._data: list[dict[str, Any]] = []
        self._rejects: list[dict[str, Any]] = []
        self._keys: list[Any] = []
        self._last_commit = time.monotonic()
        self.num_committed_rows = 0  # input rows (not samples) committed by this writer
        self.num_committed_rejects = 0
        self._tokens = {"prompt": 0, "completion": 0}

    @property
    def num_buffered_keys(self) -> int:
        return len(self._keys)

    def add_row(self, key: Any, sample_rows: list[dict[str, Any]]) -> None:
        """All samples of one input row (one output row each)."""
        self._data.extend(sample_rows)
        self._keys.append(key)
        self._tokens["completion"] += sum(r["num_completion_tokens"] for r in sample_rows)
        self._tokens["prompt"] += sample_rows[0]["num_prompt_tokens"] if sample_rows else 0

    def add_reject(self, key: Any, position: int, error_class: str, message: str) -> None:
        self._rejects.append({self.key_name: str(key), "row_position": position, "error_class": error_class,
                              "message": message[:2000]})
        self._keys.append(key)

    def should_commit(self) -> bool:
        if len(self._data) >= self.rows_per_shard:
            return True
        return bool(self._keys) and time.monotonic() - self._last_commit >= self.commit_interval_s

    def _write(self, folder: str, rows: list[dict], schema: pa.Schema) -> str:
        name = f"part-{self.manifest.tag}-{self.manifest.next_commit:06d}.parquet"
        final = self.out_dir / folder / name
        tmp = final.with_name(f".{name}.tmp")
        try:
            table = pa.Table.from_pylist(rows, schema=schema)
            with open(tmp, "wb") as f:
                pq.write_table(table, f, compression="zstd")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_dir(final.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise OSError(e.errno, f"cannot write shard in {final.parent}: {e.strerror or e}") from e
        return f"{folder}/{name}"

    def commit(self) -> bool:
        """Make every buffered row durable and done. Returns False when there was nothing to commit."""
        if not self._keys:
            return False
        faults.crash_if_armed("commit_start")
        record: dict[str, Any] = {"data": None, "rejects": None}
        if self._data:
            record["data"] = self._write("data", self._data, self.data_schema)
        if self._rejects:
            record["rejects"] = self._write("rejects", self._rejects, self.reject_schema)
        faults.crash_if_armed("shard_renamed")
        record.update(num_rows=len(self._keys), num_samples=len(self._data), num_rejects=len(self._rejects),
                      num_prompt_tokens=self._tokens["prompt"], num_completion_tokens=self._tokens["completion"],
                      time=time.time(), keys=self._keys)
        self.manifest.append(record)
        faults.crash_if_armed("commit_done")
        self.num_committed_rows += len(self._keys)
        self.num_committed_rejects += len(self._rejects)
        self._data, self._rejects, self._keys = [], [], []
        self._tokens = {"prompt": 0, "completion": 0}
        self._last_commit = time.monotonic()
        return True

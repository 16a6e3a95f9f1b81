"""Rebuilder: a manifest record made again from the shards it names, for `batchgen repair`.

A shard's own key column says which rows it holds: data shards store the key as its typed value, rejects shards as
text (output/shard_writer.py), so a rejects key is turned back into an int when the output's keys are ints (the
data shards' key type, else the records' keys, else positional keys, which rejects also hold as `row_position`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.output.ledger import Ledger


class Rebuilder:
    def __init__(self, out_dir: Path, ledger: Ledger) -> None:
        self.out_dir = out_dir
        self.schemas: dict[str, pa.Schema] = {}  # folder -> the schema of a shard a sound record names
        for folder in ("data", "rejects"):
            for path, _ in ledger.shards(folder):
                try:
                    self.schemas[folder] = pq.read_schema(path)
                    break
                except (pa.ArrowException, OSError):
                    continue
        self.int_keys: bool | None = None
        if "data" in self.schemas:
            self.int_keys = pa.types.is_integer(self.schemas["data"].field(0).type)
        else:
            typed = [k for e in ledger.entries for k in e.record["keys"][:1]]
            if typed:
                self.int_keys = isinstance(typed[0], int)

    def _read(self, rel: str) -> pa.Table | None:
        try:
            return pq.read_table(self.out_dir / rel, page_checksum_verification=True)
        except (pa.ArrowException, OSError, ValueError):
            return None

    def unsound(self, files: list[tuple[str, str]], salvaged: dict[str, dict]) -> str | None:
        """Why these shards cannot be trusted (None: they can): a size or SHA-256 other than a damaged record
        line still holds for them, unreadable Parquet (page checksums verified), or other columns than the
        output's other shards."""
        for folder, rel in files:
            path = self.out_dir / rel
            meta = salvaged.get(rel)
            if meta is not None:
                data = path.read_bytes()
                if len(data) != meta["bytes"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
                    return f"{rel} does not match the size and SHA-256 its damaged record line holds"
            table = self._read(rel)
            if table is None or table.num_columns == 0:
                return f"{rel} is not a readable Parquet file"
            if folder in self.schemas and not table.schema.equals(self.schemas[folder]):
                return f"{rel} has other columns than the output's other {folder} shards"
        return None

    def _reject_keys(self, table: pa.Table) -> list[Any]:
        texts = table.column(0).to_pylist()
        positions = table.column("row_position").to_pylist()
        int_keys = self.int_keys
        if int_keys is None:  # no data shard, no record: positional keys are the rows' positions
            int_keys = all(t == str(p) for t, p in zip(texts, positions))
        return [int(t) if int_keys else t for t in texts]

    def record(self, tag: str, commit: int, files: list[tuple[str, str]]) -> dict[str, Any] | None:
        """A record for these shards (one commit's data and/or rejects shard), or None if they disagree."""
        record: dict[str, Any] = {"commit": commit, "data": None, "rejects": None, "num_rows": 0, "num_samples": 0,
                                  "num_rejects": 0, "num_prompt_tokens": 0, "num_completion_tokens": 0}
        keys: list[Any] = []
        files_meta: dict[str, dict] = {}
        mtimes = []
        for folder, rel in files:
            table = self._read(rel)
            if table is None:
                return None
            path = self.out_dir / rel
            data = path.read_bytes()
            files_meta[rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            mtimes.append(os.stat(path).st_mtime)
            record[folder] = rel
            if folder == "data":
                rows = table.to_pylist()
                key_name = table.schema.names[0]
                first: dict[Any, dict] = {}
                for r in rows:
                    first.setdefault(r[key_name], r)
                keys += list(first)
                record["num_samples"] = len(rows)
                record["num_prompt_tokens"] = sum(r.get("num_prompt_tokens") or 0 for r in first.values())
                record["num_completion_tokens"] = sum(r.get("num_completion_tokens") or 0 for r in rows)
            else:
                keys += self._reject_keys(table)
                record["num_rejects"] = table.num_rows
        if len(set(map(str, keys))) != len(keys):
            return None  # a key in both shards, or twice in the rejects
        record.update(num_rows=len(keys), time=max(mtimes), files=files_meta, repaired=True, keys=keys)
        return record

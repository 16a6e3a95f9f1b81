"""Another job's output directory as a source (chained jobs: generate, then judge, answer or rewrite).

Rows: the upstream's committed completion rows (one per input row and sample), in manifest order: worker by
worker, commit by commit. Columns: every data column (the upstream key, `sample_idx`, its kept columns,
`completion`, `finish_reason`, token counts, `seed`, `prompt` if kept), so a template can read
`{{ completion }}`; and the lineage of each row, which `output.keep_columns` may keep (this job writes its own
key and `sample_idx`): `upstream_key` (the upstream row's key), `upstream_sample_idx` (which of its samples this
is) and `upstream_id` ("<key>#<sample_idx>": unique per upstream row, a `source.key_column` that works for an
upstream with n > 1). An upstream's own upstream_* columns are replaced: lineage reaches one job back. Only shards a manifest records are read: the upstream's rejects and a crash's leftovers
never are. The upstream's fingerprint is part of the downstream's (output/fingerprint.py), so a downstream
resume after the upstream was re-run with other settings is refused.

Damage stops the job (exit 2, naming the file): every upstream record is checked when the source opens (checksums,
shard sizes, no key in two records; output/ledger.py), each shard's row count against its footer, and each shard's
SHA-256 as it is read (the bytes are read once, hashed and parsed from memory).

Positions grow only at the end while one upstream worker commits; with several upstream workers still running,
a later commit of an earlier worker shifts positions, and so does the upstream repaired and run again: key the
downstream job (`source.key_column`) or chain on a finished upstream. A downstream keyed by position refuses to
resume once its positions moved (`order`, output/upstream_order.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import JobError
from batchgen.config import SourceSpec
from batchgen.output.damage import OutputDamaged, Problem
from batchgen.output.manifest import checked_ledger
from batchgen.output.shard_check import read_checked
from batchgen.sources.base import Source, SourceRow

BATCH_ROWS = 1024
LINEAGE_COLUMNS = ("upstream_key", "upstream_sample_idx", "upstream_id")


class OutputDirSource(Source):
    def __init__(self, spec: SourceSpec) -> None:
        super().__init__(spec.limit, spec.key_column)
        if not isinstance(spec.path, str):
            raise JobError("source.path: a batchgen output directory is one path, not a list")
        self.out_dir = Path(spec.path)
        ledger = checked_ledger(self.out_dir)
        self.shards = [(i, e) for i, e in enumerate(ledger.entries) if e.record.get("data")]
        self.files = [self.out_dir / e.record["data"] for _, e in self.shards]
        self.description = f"batchgen output {self.out_dir}"
        if not self.files:
            raise JobError(f"source.path {self.out_dir} is a batchgen output directory with no committed "
                           f"completions yet (run its job first)")
        metas = []
        for path, (i, e) in zip(self.files, self.shards):
            try:
                metas.append(pq.ParquetFile(path))
            except (pa.ArrowException, OSError) as err:
                raise OutputDamaged(self.out_dir, [Problem(e.record["data"], None, f"not a readable Parquet file "
                                                           f"({err}; {e.where} committed it)", "unreadable", i)])
            expected = e.record.get("num_samples")
            if isinstance(expected, int) and metas[-1].metadata.num_rows != expected:
                raise OutputDamaged(self.out_dir, [Problem(e.record["data"], None, f"{metas[-1].metadata.num_rows} "
                                                           f"rows, its record says {expected}", "rows", i)])
        schema = metas[0].schema_arrow
        self.upstream_key = schema.names[0]  # data shards start with the key (output/schema.py)
        lineage = [pa.field("upstream_key", schema.field(0).type), pa.field("upstream_sample_idx", pa.int32()),
                   pa.field("upstream_id", pa.string())]
        self.schema = pa.schema([f for f in schema if f.name not in LINEAGE_COLUMNS] + lineage)
        self.num_rows = sum(m.metadata.num_rows for m in metas)
        # what a row's position stands for: the committed shards in order, each with its rows (output/upstream_order)
        self.order = [[e.record["data"], m.metadata.num_rows,
                       (e.record.get("files") or {}).get(e.record["data"], {}).get("sha256")]
                      for (_, e), m in zip(self.shards, metas)]
        self.check_key_column()

    def _iter_all(self) -> Iterator[SourceRow]:
        position = 0
        for i, entry in self.shards:
            for batch in read_checked(self.out_dir, entry, i, "data").to_batches(max_chunksize=BATCH_ROWS):
                for columns in batch.to_pylist():
                    key, sample_idx = columns[self.upstream_key], columns["sample_idx"]
                    columns.update(upstream_key=key, upstream_sample_idx=sample_idx, upstream_id=f"{key}#{sample_idx}")
                    yield SourceRow(position, columns)
                    position += 1

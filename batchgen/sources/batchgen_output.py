"""Another job's output directory as a source (chained jobs: generate, then judge, answer or rewrite).

Rows: the upstream's committed completion rows (one per input row and sample), in manifest order: worker by
worker, commit by commit. Columns: every data column (the upstream key, `sample_idx`, its kept columns,
`completion`, `finish_reason`, token counts, `seed`, `prompt` if kept), so a template can read
`{{ completion }}`. Only shards a manifest records are read: the upstream's rejects and a crash's leftovers
never are. The upstream's fingerprint is part of the downstream's (output/fingerprint.py), so a downstream
resume after the upstream was re-run with other settings is refused.

Positions grow only at the end while one upstream worker commits; with several upstream workers still running,
a later commit of an earlier worker shifts positions: key the downstream job (`source.key_column`) or chain on
a finished upstream.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import JobError
from batchgen.job.spec import SourceSpec
from batchgen.output.manifest import committed_shards
from batchgen.sources.base import Source, SourceRow

BATCH_ROWS = 1024


class OutputDirSource(Source):
    def __init__(self, spec: SourceSpec) -> None:
        super().__init__(spec.limit, spec.key_column)
        if not isinstance(spec.path, str):
            raise JobError("source.path: a batchgen output directory is one path, not a list")
        self.out_dir = Path(spec.path)
        self.files = committed_shards(self.out_dir, "data")
        self.description = f"batchgen output {self.out_dir}"
        if not self.files:
            raise JobError(f"source.path {self.out_dir} is a batchgen output directory with no committed "
                           f"completions yet (run its job first)")
        try:
            metas = [pq.ParquetFile(f) for f in self.files]
        except (pa.ArrowException, OSError) as e:
            raise JobError(f"cannot read a committed shard of {self.out_dir}: {e}") from None
        self.schema = metas[0].schema_arrow
        self.num_rows = sum(m.metadata.num_rows for m in metas)
        self.check_key_column()

    def _iter_all(self) -> Iterator[SourceRow]:
        position = 0
        for path in self.files:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
                for columns in batch.to_pylist():
                    yield SourceRow(position, columns)
                    position += 1

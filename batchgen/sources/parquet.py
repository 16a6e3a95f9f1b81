"""Parquet files and globs, read one record batch at a time with pyarrow."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import JobError
from batchgen.sources.base import Source, SourceRow, check_format
from batchgen.job.spec import SourceSpec

BATCH_ROWS = 1024


def _open(path: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise JobError(f"cannot read Parquet file {path}: {e} (corrupt or truncated? re-export it or drop it "
                       f"from source.path)") from None


class ParquetSource(Source):
    def __init__(self, files: list[str], spec: SourceSpec) -> None:
        super().__init__(spec.limit, spec.key_column)
        self.files = files
        self.description = f"{len(files)} Parquet file(s) ({files[0]}{', ...' if len(files) > 1 else ''})"
        check_format(files, "parquet", type_given=spec.type is not None)
        metas = [_open(f) for f in files]
        self.schema = metas[0].schema_arrow
        for f, m in zip(files[1:], metas[1:]):
            if m.schema_arrow.names != self.schema.names:
                raise JobError(f"Parquet file {f} has columns {m.schema_arrow.names}, but {files[0]} has "
                               f"{self.schema.names}; all files of a source need the same columns")
        self.num_rows = sum(m.metadata.num_rows for m in metas)
        if self.num_rows == 0:
            raise JobError(f"{self.description} holds no rows (empty source)")
        self.check_key_column()

    def _iter_all(self) -> Iterator[SourceRow]:
        position = 0
        for path in self.files:
            try:
                for batch in _open(path).iter_batches(batch_size=BATCH_ROWS):
                    for columns in batch.to_pylist():
                        yield SourceRow(position, columns)
                        position += 1
            except pa.ArrowException as e:
                raise JobError(f"Parquet file {path} is corrupt after row {position}: {e}") from None

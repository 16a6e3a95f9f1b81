"""Parquet files and globs, read one record batch at a time with pyarrow.

All files of a source share one schema: the same column names in the same order, and each column of one type
in every file. The one allowance: a column that is all null in a file (arrow type null) takes the type the
other files give it. Any other difference (int64 in one file, string in another) is refused when the source
opens, naming the column, both types and both files: rows of two types cannot share the output's column, and
a cast would change values silently. Cast the files to one type (pyarrow: table.cast) and run again.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import JobError
from batchgen.sources.base import Source, SourceRow, check_format
from batchgen.config import SourceSpec

BATCH_ROWS = 1024


def _open(path: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise JobError(f"cannot read Parquet file {path}: {e} (corrupt or truncated? re-export it or drop it "
                       f"from source.path)") from None


def _common_schema(files: list[str], schemas: list[pa.Schema]) -> pa.Schema:
    """The one schema of all files (a null column typed by the first file that types it); JobError naming the
    column, the types and the files where two files disagree."""
    first = schemas[0]
    types: dict[str, tuple[pa.DataType, str]] = {f.name: (f.type, files[0]) for f in first}
    for path, schema in zip(files[1:], schemas[1:]):
        if schema.names != first.names:
            raise JobError(f"Parquet file {path} has columns {schema.names}, but {files[0]} has "
                           f"{first.names}; all files of a source need the same columns")
        for field in schema:
            seen, where = types[field.name]
            if pa.types.is_null(field.type) or field.type == seen:
                continue
            if pa.types.is_null(seen):
                types[field.name] = (field.type, path)
                continue
            raise JobError(f"column {field.name!r} is {seen} in Parquet file {where} but {field.type} in {path}; "
                           f"all files of a source need each column in one type: cast them to one type "
                           f"(pyarrow: table.cast) and write them again")
    return pa.schema([first.field(name).with_type(t) for name, (t, _) in types.items()], metadata=first.metadata)


class ParquetSource(Source):
    def __init__(self, files: list[str], spec: SourceSpec) -> None:
        super().__init__(spec.limit, spec.key_column)
        self.files = files
        self.description = f"{len(files)} Parquet file(s) ({files[0]}{', ...' if len(files) > 1 else ''})"
        check_format(files, "parquet", type_given=spec.type is not None)
        metas = [_open(f) for f in files]
        self.schema = _common_schema(files, [m.schema_arrow for m in metas])
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

"""The Source contract: rows in a stable order, each with its position, its columns or a parse error."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen.errors import JobError


@dataclass
class SourceRow:
    position: int  # 0-based index in the source's order (the row key when no key column is set)
    columns: dict[str, Any] | None  # None when the row could not be parsed
    error: str | None = None  # why it could not be parsed (the row is rejected, the job goes on)


class Source:
    """Subclasses set `schema` (arrow schema of the columns), `num_rows` (None if unknown without a full scan)
    and implement `_iter_all`. `limit` is applied here."""

    schema: pa.Schema
    num_rows: int | None
    description: str
    typed: bool = True  # values always match `schema` (Parquet, datasets); False for JSONL (inferred)

    def __init__(self, limit: int | None, key_column: str | None) -> None:
        self.limit = limit
        self.key_column = key_column

    @property
    def columns(self) -> list[str]:
        return list(self.schema.names)

    def check_key_column(self) -> None:
        if self.key_column is not None and self.key_column not in self.columns:
            raise JobError(f"source.key_column {self.key_column!r} is not a column of {self.description}; "
                           f"columns: {', '.join(self.columns)}")

    def _iter_all(self) -> Iterator[SourceRow]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[SourceRow]:
        for row in self._iter_all():
            if self.limit is not None and row.position >= self.limit:
                return
            yield row

    @property
    def expected_rows(self) -> int | None:
        if self.num_rows is None:
            return self.limit
        return min(self.num_rows, self.limit) if self.limit is not None else self.num_rows

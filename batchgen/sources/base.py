"""The Source contract: rows in a stable order, each with its position, its columns or a parse error."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.errors import JobError


@dataclass
class SourceRow:
    position: int  # 0-based index in the source's order (the row key when no key column is set)
    columns: dict[str, Any] | None  # None when the row could not be parsed
    error: str | None = None  # why it could not be parsed (the row is rejected, the job goes on)
    key: str | None = None  # for an unparsed row, its key where one is still known (an OpenAI line's custom_id)


def is_output_dir(path: Path) -> bool:
    """A batchgen output directory (a chained job's source): it has a manifest/ and a data/ folder."""
    return path.is_dir() and (path / "manifest").is_dir() and (path / "data").is_dir()


PARQUET_MAGIC = b"PAR1"  # every Parquet file begins (and ends) with these four bytes


def sniff_format(path: str) -> str | None:
    """"parquet" or "jsonl" from a file's first bytes; None when neither is recognisable (gzip, empty, other)."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(PARQUET_MAGIC):
        return "parquet"
    if head.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"{"):  # a UTF-8 byte order mark is allowed
        return "jsonl"
    return None


def check_format(files: list[str], expected: str, type_given: bool) -> None:
    """A Parquet file named .jsonl, or a JSONL file named .parquet: say so, instead of a parse error later."""
    names = {"parquet": "Parquet", "jsonl": "JSONL"}
    for path in files:
        actual = sniff_format(path)
        if actual is not None and actual != expected:
            said = f"source.type {expected}" if type_given else "its extension"
            raise JobError(f"file {path} looks like {names[actual]} (it begins with "
                           f"{'PAR1' if actual == 'parquet' else '{'}), but {said} says {names[expected]}; "
                           f"{'set source.type' if type_given else 'rename it or set source.type'}: {actual}")


class Source:
    """Subclasses set `schema` (arrow schema of the columns), `num_rows` (None if unknown without a full scan)
    and implement `_iter_all`. `limit` is applied here."""

    schema: pa.Schema
    num_rows: int | None
    description: str
    typed: bool = True  # values always match `schema` (Parquet, datasets); False for JSONL (inferred)
    quiet: bool = False  # True: read again for bookkeeping (export's row order): no notices on stderr

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

    def progress_rows(self) -> int | None:
        """The progress bar's total: `expected_rows`, or a count where one is cheap (JSONL overrides)."""
        return self.expected_rows

    @property
    def expected_rows(self) -> int | None:
        if self.num_rows is None:
            return self.limit
        return min(self.num_rows, self.limit) if self.limit is not None else self.num_rows

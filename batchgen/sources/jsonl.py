"""JSON Lines files: one object per line; a malformed line becomes a rejected row, the job goes on."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from itertools import islice

import pyarrow as pa

from batchgen.errors import JobError
from batchgen.sources.base import Source, SourceRow
from batchgen.job.spec import SourceSpec

SCHEMA_SAMPLE_ROWS = 1000


def _lines(path: str) -> Iterator[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        yield from f


def _parse(line: str) -> tuple[dict | None, str | None]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"malformed JSON: {e}"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object per line, got {type(obj).__name__}"
    return obj, None


class JsonlSource(Source):
    typed = False  # the schema is inferred from the first rows; later rows may disagree
    def __init__(self, files: list[str], spec: SourceSpec) -> None:
        super().__init__(spec.limit, spec.key_column)
        self.files = files
        self.description = f"{len(files)} JSONL file(s) ({files[0]}{', ...' if len(files) > 1 else ''})"
        self.num_rows = None  # counting lines would need a full read
        sample = [obj for obj, _ in (_parse(line) for line in islice(self._nonblank(), SCHEMA_SAMPLE_ROWS))
                  if obj is not None]
        if not sample:
            raise JobError(f"{self.description} holds no JSON objects (empty source?)")
        names: dict[str, None] = {}
        for obj in sample:
            names.update(dict.fromkeys(obj))
        try:
            inferred = pa.Table.from_pylist(sample).schema
        except (pa.ArrowException, TypeError):
            inferred = None
        fields = []
        for name in names:
            t = inferred.field(name).type if inferred is not None and name in inferred.names else pa.string()
            fields.append(pa.field(name, pa.string() if pa.types.is_null(t) else t))
        self.schema = pa.schema(fields)
        self.check_key_column()

    def _nonblank(self) -> Iterator[str]:
        for path in self.files:
            for line in _lines(path):
                if line.strip():
                    yield line

    def _iter_all(self) -> Iterator[SourceRow]:
        for position, line in enumerate(self._nonblank()):
            obj, error = _parse(line)
            yield SourceRow(position, obj, error)

    def count_rows(self) -> int:
        """A full scan (for `batchgen status`): non-blank lines, capped by the limit."""
        n = sum(1 for _ in self._nonblank())
        return min(n, self.limit) if self.limit is not None else n

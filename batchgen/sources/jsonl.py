"""JSON Lines files: one object per line; a malformed line becomes a rejected row, the job goes on.

Text is UTF-8: a byte order mark at the start of a file is dropped; a line that is not valid UTF-8 is a
malformed row naming its file, line and byte (its text is never guessed or replaced)."""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from itertools import islice

import pyarrow as pa

from batchgen.errors import JobError
from batchgen.output.schema import JSON_TEXT_METADATA
from batchgen.sources.base import Source, SourceRow, check_format
from batchgen.config import SourceSpec

SCHEMA_SAMPLE_ROWS = 1000
PROGRESS_SCAN_BYTES = 1 << 30  # count a JSONL source's rows for the progress bar up to this size


BOM = b"\xef\xbb\xbf"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lines(path: str) -> Iterator[str | UnicodeDecodeError]:
    """The file's lines as text; a line that is not UTF-8 as its UnicodeDecodeError (its `object` the line's
    bytes, `start` the first bad byte), annotated with the file and line number in `reason`."""
    opener = gzip.open if path.endswith(".gz") else open
    number = 0
    with opener(path, "rb") as f:
        try:
            for number, raw in enumerate(f, 1):
                if number == 1:
                    raw = raw.removeprefix(BOM)
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield UnicodeDecodeError("utf-8", raw, e.start, e.end,
                                             f"line {number} of {path} is not valid UTF-8 (byte {e.start}: "
                                             f"{raw[e.start:e.start + 1]!r}, {e.reason})")
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # the file, not one row: no rerun mends it
            raise JobError(f"source file {path} is not a readable gzip file after line {number} "
                           f"({type(e).__name__}: {e}): repair or replace the file"
                           ) from None


def parse_line(line: str | UnicodeDecodeError) -> tuple[dict | None, str | None]:
    if isinstance(line, UnicodeDecodeError):
        return None, line.reason
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"malformed JSON: {e}"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object per line, got {type(obj).__name__}"
    if _SURROGATE_ESCAPE.search(line):  # json.loads pairs surrogates; a lone one is no character
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            return None, (f"a string holds {e.object[e.start]!r}, a lone UTF-16 surrogate escape, which is not a "
                          f"character (no tokenizer or Parquet file can hold it)")
    return obj, None


def _kind(value) -> str:
    """A JSON value's kind; ints and floats are both numbers (a float column takes 3 as well as 2.5)."""
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


def _nulls_as_strings(t: pa.DataType) -> pa.DataType:
    """Null types (only nulls seen, e.g. `"name": null` in every sampled message) become string, at any depth."""
    if pa.types.is_null(t):
        return pa.string()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(_nulls_as_strings(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _nulls_as_strings(f.type)) for f in t])
    return t


def column_type(values: list) -> pa.DataType:
    """A column's type from its values in the first rows: arrow's inference over all of them; where they mix
    kinds (5 and "five"), the type of the most common kind (the first seen on a tie). Rows whose value does
    not fit become `schema_mismatch` rejects when the column is kept (output/schema.py). All null: string.
    Objects that no one arrow type holds ({"stop": "e"} and {"stop": ["a", "b"]}): string, a JSON text column
    (`json_text_column`: its field carries JSON_TEXT_METADATA, and a kept object is written as its JSON text)."""
    return _infer(values)[0]


def json_text_column(values: list) -> bool:
    """Whether the column is kept as JSON text: its values in the first rows are mostly objects, and arrow finds
    no one type for those objects (shapes that clash, an int beyond 64 bits inside one)."""
    return _infer(values)[1]


def _infer(values: list) -> tuple[pa.DataType, bool]:
    """(the column's type, whether it is a JSON text column)."""
    present = [v for v in values if v is not None]
    if not present:
        return pa.string(), False
    majority = Counter(_kind(v) for v in present).most_common(1)[0][0]
    same_kind = [v for v in present if _kind(v) == majority]
    for candidates in (present, same_kind):
        try:
            return _nulls_as_strings(pa.array(candidates).type), False
        except (pa.ArrowException, OverflowError, TypeError):
            continue
    if majority == "dict":  # every object fits as its JSON text, which per-row consumers read as the object
        return pa.string(), True
    try:
        return _nulls_as_strings(pa.array(same_kind[:1]).type), False
    except (pa.ArrowException, OverflowError, TypeError):  # not even one value has an arrow type (an int beyond
        return pa.string(), False  # 64 bits): every value mismatches




class JsonlSource(Source):
    typed = False  # the schema is inferred from the first rows; later rows may disagree
    def __init__(self, files: list[str], spec: SourceSpec) -> None:
        super().__init__(spec.limit, spec.key_column)
        self.files = files
        self.description = f"{len(files)} JSONL file(s) ({files[0]}{', ...' if len(files) > 1 else ''})"
        self.num_rows = None  # counting lines would need a full read
        check_format(files, "jsonl", type_given=spec.type is not None)
        for path in (f for f in files if f.endswith(".json")):  # a JSON document holding an array: no line is a row
            start = next((line for line in _lines(path) if isinstance(line, UnicodeDecodeError) or line.strip()), "")
            if isinstance(start, str) and start.lstrip().startswith("["):
                raise JobError(f"{path} starts with '[': a JSON array, where batchgen reads JSON Lines (one object "
                               f"per line); convert it, e.g. jq -c '.[]' IN > OUT.jsonl")
        first = islice(self.nonblank_lines(), SCHEMA_SAMPLE_ROWS)
        sample = [obj for obj, _ in (parse_line(line) for _, _, line in first) if obj is not None]
        if not sample:
            raise JobError(f"{self.description} holds no JSON objects (empty source?)")
        names: dict[str, None] = {}
        for obj in sample:
            names.update(dict.fromkeys(obj))
        inferred = {n: _infer([obj.get(n) for obj in sample]) for n in names}
        # a key is never JSON text: an object key still stops the job (keys are strings or integers)
        self.schema = pa.schema([pa.field(n, t, metadata=JSON_TEXT_METADATA if as_text and n != spec.key_column
                                          else None) for n, (t, as_text) in inferred.items()])
        self.check_key_column()

    def nonblank_lines(self) -> Iterator[tuple[str, int, str | UnicodeDecodeError]]:
        """(file, line number, line) of every line that is not blank."""
        for path in self.files:
            for number, line in enumerate(_lines(path), 1):
                if isinstance(line, UnicodeDecodeError) or line.strip():
                    yield path, number, line

    def _iter_all(self) -> Iterator[SourceRow]:
        for position, (path, number, line) in enumerate(self.nonblank_lines()):
            obj, error = parse_line(line)
            if error is not None and not isinstance(line, UnicodeDecodeError):  # that one names its line already
                error = f"line {number} of {path}: {error}"
            yield SourceRow(position, obj, error)

    def progress_rows(self) -> int | None:
        """Rows for the progress bar: counted when the files are uncompressed and at most PROGRESS_SCAN_BYTES
        together (a line scan, ~1 s per 500 MB), else unknown."""
        if self.expected_rows is not None:
            return self.expected_rows
        if any(f.endswith(".gz") for f in self.files) or sum(os.path.getsize(f) for f in self.files) > \
                PROGRESS_SCAN_BYTES:
            return None
        return self.count_rows()

    def count_rows(self) -> int:
        """A full scan (for `batchgen status`): non-blank lines, capped by the limit."""
        n = sum(1 for _ in self.nonblank_lines())
        return min(n, self.limit) if self.limit is not None else n

"""Rows with array-valued cells become the same Arrow table as pyarrow's own conversion of their Python values."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from batchgen.output.arrow_columns import GridCell, table
from batchgen.output.generation_columns import TOP_LOGPROB

SCHEMA = pa.schema([pa.field("key", pa.int64()), pa.field("lp", pa.list_(pa.float32())),
                    pa.field("top", pa.list_(pa.list_(TOP_LOGPROB)))])


def _python(cell):
    """The Python value from_pylist takes for a cell."""
    if isinstance(cell, GridCell):
        ids, values = cell.fields
        return [[{"token_id": int(i), "logprob": float(v)} for i, v in zip(ri, rv)] for ri, rv in zip(ids, values)]
    return cell.tolist() if isinstance(cell, np.ndarray) else cell


def _grid(rng, t: int, k: int) -> GridCell:
    return GridCell((rng.integers(0, 50_000, (t, k)).astype(np.int32), rng.standard_normal((t, k)).astype(np.float32)))


def test_array_cells_give_the_table_from_pylist_gives_for_their_python_values():
    rng = np.random.default_rng(0)
    rows = [{"key": 0, "lp": rng.standard_normal(5).astype(np.float32), "top": _grid(rng, 5, 3)},
            {"key": 1, "lp": None, "top": None},  # a null cell in each fast path
            {"key": 2, "lp": np.zeros(0, np.float32), "top": _grid(rng, 0, 3)},  # nothing generated
            {"key": 3, "lp": rng.standard_normal(2).astype(np.float32), "top": _grid(rng, 2, 5)},  # another K
            {"key": 4}]  # missing keys are nulls
    fast = table(rows, SCHEMA)
    slow = pa.Table.from_pylist([{k: _python(v) for k, v in r.items()} for r in rows], schema=SCHEMA)
    assert fast.equals(slow)
    assert fast.column("top").to_pylist()[3][1][4]["token_id"] == int(rows[3]["top"].fields[0][1, 4])


def test_plain_python_cells_still_convert_and_mixed_grid_cells_are_refused():
    rows = [{"key": 0, "lp": [1.0, 2.0], "top": None}, {"key": 1, "lp": None, "top": None}]
    assert table(rows, SCHEMA).equals(pa.Table.from_pylist(rows, schema=SCHEMA))
    rng = np.random.default_rng(1)
    with pytest.raises(TypeError, match="mixes GridCell"):
        table([{"key": 0, "top": _grid(rng, 1, 1)}, {"key": 1, "top": [[{"token_id": 1, "logprob": 0.0}]]}], SCHEMA)

"""ListMirror: a read-only numpy view of a Python list of ints, kept in step at O(new entries) a call.

The scheduler hands each step's block tables to the runner as such views, so the step's arrays are filled by
memory copies instead of converting every id of every sequence from Python on every step.

Invariant that makes handing out views safe: the mirrored list only grows by appends in place, or is
replaced by a new list (which gets a new buffer). An earlier view keeps its contents: appends write past its
end, and a full buffer is replaced (the view keeps the old one).
"""

from __future__ import annotations

import numpy as np


class ListMirror:
    def __init__(self, dtype: type, min_capacity: int = 16) -> None:
        self._dtype = dtype
        self._min_capacity = min_capacity
        self._src: list[int] | None = None  # the list mirrored
        self._buf = np.empty(0, dtype)
        self._len = 0  # entries of _src copied into _buf
        self._view: np.ndarray | None = None  # the latest view handed out

    def view(self, src: list[int]) -> np.ndarray:
        n = len(src)
        if self._src is src and self._view is not None and len(self._view) == n == self._len:
            return self._view  # unchanged since the last call: most decode steps
        if self._src is not src:
            self._src, self._len, self._view = src, 0, None
            self._buf = np.empty(max(self._min_capacity, n + 1), self._dtype)
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf)), self._dtype)
            grown[:self._len] = self._buf[:self._len]
            self._buf = grown
        if n > self._len:
            self._buf[self._len:n] = src[self._len:n]
            self._len = n
        view = self._buf[:n]
        view.flags.writeable = False
        self._view = view
        return view

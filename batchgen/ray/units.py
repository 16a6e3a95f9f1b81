"""Work units and the feed that turns dealt units into rows for a JobLoop (job/feed.py's contract).

A unit is a range of source positions. The driver deals units to workers as they ask for more; a worker reads
its units' rows from the source and reports a unit done once every row of it is committed (or was committed by an
earlier run). A unit whose worker died is dealt again with `recheck`: the new worker reads every worker's
committed keys first, so the rows the dead one committed are skipped (exactly once).

Threads: the worker's loop thread calls next_row / row_* / committed; deal / close / poll come from the calls
the driver makes (other threads of the same actor). The lock guards what both touch.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from batchgen.job.feed import WAIT
from batchgen.sources.base import Source, SourceRow

MIN_UNIT_ROWS = 8
MAX_UNIT_ROWS = 512
UNITS_PER_WORKER = 32  # a worker's share is cut this fine: the last unit of the job is a small tail


@dataclass(frozen=True)
class Unit:
    unit_id: int
    start: int  # first source position
    stop: int  # one past the last
    recheck: bool = False  # dealt again after its worker failed: read the committed keys before its rows

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


def unit_rows_for(num_rows: int, num_workers: int) -> int:
    """Small enough that workers finish together (a worker's share in UNITS_PER_WORKER units), large enough
    that reading and dealing cost nothing beside generation."""
    return max(MIN_UNIT_ROWS, min(MAX_UNIT_ROWS, num_rows // max(1, num_workers * UNITS_PER_WORKER)))


def plan_units(num_rows: int, unit_rows: int) -> list[Unit]:
    return [Unit(i, start, min(start + unit_rows, num_rows))
            for i, start in enumerate(range(0, num_rows, unit_rows))]


@dataclass
class _Open:
    """A unit this worker has begun reading, until its rows are committed."""

    unit: Unit
    outstanding: set[int] = field(default_factory=set)  # positions read, not yet skipped or handed to the writer
    last_entry: int = -1  # the writer entry number of its last handed row (-1: none)
    read_all: bool = False


class UnitFeed:
    """Rows of the units dealt to this worker, in the order dealt. Before `attach`, units only queue."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[Unit] = deque()  # dealt, not begun
        self._closed = False  # the driver deals no more: None once the queue is read
        self._all_dealt = False  # the driver's queue is empty: no unit is to come unless one is dealt again
        self._done: list[int] = []  # unit ids committed, not yet reported by poll
        self._num_queued_rows = 0
        # the loop thread's own state
        self._source: Source | None = None
        self._refresh: Callable[[], None] = lambda: None
        self._rows: Iterator[SourceRow] | None = None
        self._peek: SourceRow | None = None  # the next source row, read but not returned
        self._last_read = -1  # the position of the last row taken from self._rows
        self._current: _Open | None = None
        self._open: list[_Open] = []
        self._num_handed = 0  # writer entries handed (rows and rejects)
        self._num_committed = 0  # writer entries committed (FIFO: entry e is committed iff e < this)

    def attach(self, source: Source, refresh_done_keys: Callable[[], None]) -> None:
        self._source, self._refresh = source, refresh_done_keys

    # ---- the driver's side --------------------------------------------------------------------------
    def deal(self, units: list[Unit]) -> None:
        with self._cond:
            self._queue.extend(units)
            self._num_queued_rows += sum(u.num_rows for u in units)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def mark_all_dealt(self) -> None:
        """The driver has dealt its whole queue (calls may arrive in any order on a threaded actor: this flag
        is never cleared by a later deal; a unit dealt again after a failure only meets it early)."""
        with self._cond:
            self._all_dealt = True
            self._cond.notify_all()

    def poll(self) -> dict:
        """Units committed since the last poll, and how many dealt rows are not yet read."""
        with self._cond:
            done, self._done = self._done, []
            current = self._current
            unread = self._num_queued_rows + (current.unit.num_rows - len(current.outstanding) if current else 0)
            return {"done": done, "num_unread_rows": unread, "num_queued_units": len(self._queue)}

    # ---- the loop's side (job/feed.py) --------------------------------------------------------------
    def next_row(self) -> SourceRow | None:
        while True:
            if self._current is None:
                with self._cond:
                    if not self._queue:
                        return None if self._closed else WAIT
                    unit = self._queue.popleft()
                    self._num_queued_rows -= unit.num_rows
                    self._current = _Open(unit)
                    self._open.append(self._current)
                self._seek(unit.start)
                if unit.recheck:  # another worker held it: skip what that one committed
                    self._refresh()
            row = self._read(self._current.unit)
            if row is not None:
                self._current.outstanding.add(row.position)
                return row
            opened, self._current = self._current, None
            opened.read_all = True
            self._settle(opened)

    def all_dealt(self) -> bool:
        with self._cond:
            return self._all_dealt or self._closed

    def wait(self, timeout_s: float) -> None:
        with self._cond:
            if not self._queue and not self._closed:
                self._cond.wait(timeout_s)

    def row_skipped(self, position: int) -> None:
        opened = self._owner(position)
        opened.outstanding.discard(position)
        self._settle(opened)

    def row_handed(self, position: int) -> None:
        opened = self._owner(position)
        opened.outstanding.discard(position)
        opened.last_entry = self._num_handed
        self._num_handed += 1
        self._settle(opened)

    def committed(self, num_entries: int) -> None:
        self._num_committed += num_entries
        for opened in list(self._open):
            self._settle(opened)

    # ---- internals ----------------------------------------------------------------------------------
    def _owner(self, position: int) -> _Open:
        for opened in self._open:
            if opened.unit.start <= position < opened.unit.stop:
                return opened
        raise AssertionError(f"row {position} belongs to no unit this worker holds")

    def _settle(self, opened: _Open) -> None:
        """Report the unit done once it is read, no row of it is in flight, and its last entry is committed."""
        if opened.read_all and not opened.outstanding and opened.last_entry < self._num_committed:
            self._open.remove(opened)
            with self._cond:
                self._done.append(opened.unit.unit_id)

    def _seek(self, start: int) -> None:
        """Before a unit's first row: units are dealt in source order, so the source is read forward; one behind
        what was read (a unit dealt again) opens the source anew."""
        passed = self._peek.position > start if self._peek is not None else self._last_read >= start
        if self._rows is None or passed:
            self._rows, self._peek, self._last_read = iter(self._source), None, -1

    def _read(self, unit: Unit) -> SourceRow | None:
        """The next row of `unit`, or None past its end."""
        while True:
            if self._peek is None:
                self._peek = next(self._rows, None)
                if self._peek is None:
                    return None  # the source ended (its row count was smaller than the units said)
                self._last_read = self._peek.position
            row = self._peek
            if row.position >= unit.stop:
                return None
            self._peek = None
            if row.position >= unit.start:
                return row

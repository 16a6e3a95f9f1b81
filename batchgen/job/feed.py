"""Row feeds: where a worker's rows come from. The JobLoop reads rows from a feed and tells it what became of
each one; the feed decides which rows are this worker's.

- StaticFeed: a fixed partition (WorkerInfo.owns: units dealt round-robin by worker index), read in one pass.
  Slurm arrays, torchrun, Kubernetes and `--workers/--gpus` use it.
- A dealt feed (batchgen/ray/units.py): units of rows handed out while the job runs. It may have no row *now*
  and more later (WAIT), and it learns when each of its rows is committed.

Contract: next_row() returns a SourceRow, WAIT (none now; ask again after stepping the engine or wait()) or None
(no more rows, ever). Every row returned is later reported exactly once to row_skipped (committed by an earlier
run) or row_handed (given to the shard writer as a row or a reject); committed(n) follows every writer commit of
n entries (the writer commits in the order rows were handed: FIFO). all_dealt(): no row is left to come but those
held (a dealt feed whose dealer has handed out its whole queue; a static feed: always).
"""

from __future__ import annotations

from collections.abc import Iterator

from batchgen.job.workers import WorkerInfo
from batchgen.sources.base import Source, SourceRow


class _Wait:
    def __repr__(self) -> str:
        return "WAIT"


WAIT = _Wait()  # next_row(): no row now, perhaps later


class StaticFeed:
    """This worker's part of the source (WorkerInfo.owns), in source order; never WAIT."""

    def __init__(self, source: Source, worker: WorkerInfo) -> None:
        self._rows: Iterator[SourceRow] = iter(source)
        self._worker = worker

    def next_row(self) -> SourceRow | None:
        for row in self._rows:
            if self._worker.owns(row.position):
                return row
        return None

    def wait(self, timeout_s: float) -> None:  # never asked: a static feed has no WAIT
        pass

    def row_skipped(self, position: int) -> None:
        pass

    def row_handed(self, position: int) -> None:
        pass

    def committed(self, num_entries: int) -> None:
        pass

    def all_dealt(self) -> bool:
        return True

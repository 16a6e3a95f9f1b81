"""A chained job keyed by position: the upstream rows its positions stand for (OUT/upstream_order.json).

A downstream job without `source.key_column` keys a row by its position in the upstream's committed rows (manifest
order: worker by worker, commit by commit). Those positions hold only while the upstream's records grow at the end.
After the upstream was repaired and run again (a damaged shard's rows committed anew, last) or one of its earlier
workers committed late, position P is another upstream row: a resume would answer some rows twice and others never.

So the downstream records the upstream's committed shards in order, each with its row count and SHA-256 ([[name,
rows, sha256], ...]: a shard generated again may reuse its name), and a resume is refused unless what it recorded is
still where it was: the upstream's records now start with it (those within source.limit; before the downstream
committed anything, nothing is refused).
A keyed downstream needs none of this (its keys do not move) and records nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from batchgen.errors import JobError
from batchgen.output.layout import UPSTREAM_ORDER_FILE as FILE
from batchgen.output.temp_file import write_text_atomic

Order = list[list]  # [[data shard path inside the upstream output, its rows, its SHA-256], ...] in row order


def _stored(out_dir: Path) -> Order | None:
    path = out_dir / FILE
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_bytes())["shards"]
        if not isinstance(stored, list):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise JobError(f"{path} is damaged: it records which upstream rows this output's positions stand for. Start "
                       f"over with --fresh, or key the job (source.key_column: upstream_id) in a new output.dir") \
            from None
    return stored


def _within(order: Order, limit: int | None) -> Order:
    """The shards that hold the first `limit` rows (source.limit; None: all): rows beyond it are never read."""
    if limit is None:
        return order
    kept, rows = [], 0
    for entry in order:
        if rows >= limit:
            break
        kept.append(entry)
        rows += entry[1]
    return kept


def _committed(out_dir: Path) -> bool:
    """Whether any worker of the downstream committed (a record in manifest/): before that, no position stands
    for anything yet."""
    manifests = out_dir / "manifest"
    return manifests.is_dir() and any(p.is_file() and p.stat().st_size > 0 for p in manifests.iterdir())


def _same(was: list, now: list | None) -> bool:
    """A recorded shard is where it was: the same name and rows (and SHA-256 where both record one)."""
    return now is not None and now[:len(was)] == was[:len(now)]


def _still_there(stored: Order, order: Order) -> bool:
    return len(order) >= len(stored) and all(_same(was, now) for was, now in zip(stored, order))


def refusal(out_dir: Path, upstream: Path, order: Order) -> str | None:
    """Why a position-keyed downstream in `out_dir` may not resume on the upstream's committed shards `order` (all
    of them: the record covers the shards within the source.limit of every earlier run, and those must still lead
    the upstream whatever this run's limit is). None: nothing recorded or committed yet, or every recorded shard is
    still where it was. Reads only."""
    stored = _stored(out_dir)
    if stored is None or _still_there(stored, order) or not _committed(out_dir):
        return None
    moved = next(i for i, (was, now) in enumerate(zip(stored + [None], order + [None]))
                 if was is None or not _same(was, now))
    was = stored[moved][0] if moved < len(stored) else "nothing"
    now = order[moved][0] if moved < len(order) else "nothing"
    return (f"refusing to resume into {out_dir}: its rows are keyed by position in the upstream output {upstream}, "
            f"and the upstream's committed rows moved since (its record {moved + 1} was {was}, now {now}: the "
            f"upstream was repaired and run again, or an earlier worker of it committed late). Resuming would "
            f"answer some upstream rows twice and skip others. Start over with --fresh, and key the job by the "
            f"upstream row (source.key_column: upstream_id) so that it can resume whatever the upstream does")


def check_and_record(out_dir: Path, upstream: Path, order: Order, limit: int | None = None) -> None:
    """Before a position-keyed downstream reads its rows: JobError when `refusal` says so, else record the shards
    within source.limit `limit` (the upstream may have grown: later positions stand for its new rows); a record
    never shrinks while anything is committed (a lower limit: what was committed beyond it still stands for those
    shards)."""
    message = refusal(out_dir, upstream, order)
    if message is not None:
        raise JobError(message)
    stored = _stored(out_dir)
    kept = len(stored) if stored is not None and _committed(out_dir) else 0
    keep = max(len(_within(order, limit)), kept)
    if stored != order[:keep]:
        write_text_atomic(out_dir / FILE, json.dumps({"upstream": str(upstream), "shards": order[:keep]}) + "\n")

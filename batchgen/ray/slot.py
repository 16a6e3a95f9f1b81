"""One worker of a Ray job as the driver sees it (driver.py): its actor (and, with tensor parallelism, its other ranks
and their placement group), the units dealt to it and not yet reported committed, and what its last poll said; how
its ranks' failures are read and how all of it is let go at once."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from batchgen.errors import JobError
from batchgen.ray import cluster
from batchgen.ray.units import Unit


@dataclass
class Slot:
    index: int
    actor: object
    run_ref: object
    held: dict[int, Unit] = field(default_factory=dict)  # dealt, not yet reported committed
    poll_ref: object = None
    created_at: float = field(default_factory=time.monotonic)
    placed: bool = False  # its actor answered a poll: the cluster found it room
    said_waiting: bool = False
    started: bool = False
    num_unread_rows: int = 0  # dealt rows the actor has not read (as of its last poll, plus those dealt since)
    num_queued_units: int = 0
    num_wanted_rows: int = 0
    failures: int = 0
    generated_tokens: int = 0
    result: dict | None = None
    finished: bool = False  # its run returned (result) or it was let go after the last unit
    # a tensor-parallel worker's ranks 1..T-1 (ranks.py), their run calls not yet returned, and its placement group
    ranks: list = field(default_factory=list)
    rank_refs: dict = field(default_factory=dict)  # rank -> its run call's ObjectRef
    group: object = None


class RankFailed(Exception):
    """Rank `rank` (> 0) of a tensor-parallel worker failed with `error`."""

    def __init__(self, rank: int, error: Exception) -> None:
        super().__init__(f"rank {rank}: {error}")
        self.rank, self.error = rank, error


def rank_error(ray, s: Slot) -> Exception | None:
    """The error of the first of a worker's ranks 1..T-1 whose run call failed, else None (a rank returns at rank
    0's STOP: its ref is then dropped)."""
    for rank, ref in sorted(s.rank_refs.items()):
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            continue
        try:
            ray.get(ref)
            del s.rank_refs[rank]
        except Exception as e:
            return RankFailed(rank, e)
    return None


def kill(ray, s: Slot) -> None:
    """A worker's actors (all its ranks) and placement group, gone at once."""
    for actor in [a for a in (s.actor, *s.ranks) if a is not None]:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass  # already gone
    s.ranks, s.rank_refs = [], {}
    if s.group is not None:
        s.group.remove()
        s.group = None


def first_line(error: BaseException) -> str:
    """What an error says, in a line: the actor's own error where Ray wraps one (RayTaskError.cause); Ray's
    first line says what happened."""
    error = getattr(error, "cause", error)
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def is_job_error(error: Exception) -> bool:
    """A JobError, raised here or inside an actor (Ray wraps it: RayTaskError.cause)."""
    return isinstance(error, JobError) or isinstance(getattr(error, "cause", None), JobError)


def bundle(resources: dict) -> dict:
    """A placement-group bundle holding one rank's actor options ({"num_gpus": 1, ...} -> {"GPU": 1, ...})."""
    return {cluster.RESOURCE_NAMES[k]: v for k, v in resources.items()}

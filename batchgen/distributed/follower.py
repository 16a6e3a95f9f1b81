"""The other ranks' loop: run each step rank 0 sends, until it sends STOP.

A follower mirrors rank 0's async pipeline: it dispatches step N+1 before collecting step N, so its host
prepares the next step while its device runs the current one (collecting first would leave its GPU idle at the
next step's first all-reduce while its host prepared, stalling every rank). Its StepOutputs are dropped: rank 0
owns the output. They are folded into a digest, which tests compare with rank 0's: equal digests mean every rank
sampled the same tokens (the invariant the carry-over of placeholders relies on, see __init__.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from batchgen.distributed.plan import STOP, PlanChannel
from batchgen.engine.batch import ScheduledBatch, StepOutput


@dataclass(frozen=True)
class FollowResult:
    num_steps: int
    token_digest: str  # sha256 over every step's sampled ids, in order (token_digest_update)


def token_digest_update(digest, output: StepOutput) -> None:
    digest.update(np.asarray(output.token_ids, dtype=np.int64).tobytes())


def follow(runner, plans: PlanChannel) -> FollowResult:
    """Serve rank 0's steps on `runner` (this rank's ModelRunner) until STOP; the caller closes the engine."""
    digest = hashlib.sha256()
    num_steps = 0
    in_flight = None
    while True:
        message = plans.recv()
        if isinstance(message, str):
            if message == STOP:
                break
            raise RuntimeError(f"tensor-parallel follower: unexpected message {message!r} from rank 0")
        assert isinstance(message, ScheduledBatch), type(message)
        step = runner.dispatch(message)
        if in_flight is not None:
            token_digest_update(digest, runner.collect(in_flight))
        in_flight = step
        num_steps += 1
    if in_flight is not None:
        token_digest_update(digest, runner.collect(in_flight))
    return FollowResult(num_steps, digest.hexdigest())

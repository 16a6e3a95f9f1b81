"""PlanChannel: rank 0's messages to the other ranks of its tensor-parallel group, in order, on a gloo group.

Messages: BUILD (a job is about to build its engine: load your shard and build yours), then one ScheduledBatch
per step (engine/batch.py: plain data, pickled; the block tables' numpy views pickle as copies), then STOP (the
engine closed, or the job ended without building one). A gloo group, not the device group: on CUDA the
broadcast is host-to-host, so rank 0's async pipeline never waits on device work to send a plan, and a follower
waiting for the next plan holds no GPU stream.

Hazard: the followers block in `recv` while rank 0 does anything else (admitting rows, committing shards); the
group's timeout (groups.PLAN_TIMEOUT) bounds that wait, and a dead rank 0 leaves them there until the launcher
(or torchrun) ends them.
"""

from __future__ import annotations

import torch.distributed as dist

BUILD = "build"
STOP = "stop"


class PlanChannel:
    def __init__(self, cpu_group, src_global_rank: int, is_leader: bool) -> None:
        self.group = cpu_group
        self.src = src_global_rank  # the group's rank 0, as a global rank (broadcast's `src`)
        self.is_leader = is_leader
        self.stopped = False  # STOP sent last; False: the other ranks still wait for a message that ends them
        self.num_steps_sent = 0

    def _send(self, message) -> None:
        assert self.is_leader, "only rank 0 of a tensor-parallel group sends plans"
        dist.broadcast_object_list([message], src=self.src, group=self.group)

    def send_build(self) -> None:
        self._send(BUILD)
        self.stopped = False

    def send_step(self, batch) -> None:
        self._send(batch)
        self.num_steps_sent += 1

    def send_stop(self) -> None:
        self._send(STOP)
        self.stopped = True

    def release_followers(self) -> None:
        """Rank 0 at its end: STOP to the other ranks if they still wait (no engine was built, a refused or
        finished job, or it failed mid-build). A rank already gone is its launcher's to end (Ray: the driver's):
        the first error stands."""
        if self.stopped:
            return
        try:
            self.send_stop()
        except Exception:
            pass

    def recv(self):
        """The next message from rank 0: BUILD, STOP, or a ScheduledBatch."""
        assert not self.is_leader
        box = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

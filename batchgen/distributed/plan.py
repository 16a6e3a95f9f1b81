"""PlanChannel: rank 0's messages to the other ranks of its tensor-parallel group, in order, on a gloo group.

Messages: BUILD (a job is about to build its engine: load your shard and build yours), then one ScheduledBatch
per step (engine/batch.py: plain data, pickled; the block tables' numpy views pickle as copies), then STOP (the
engine closed, or the job ended without building one). A gloo group, not the device group: on CUDA the
broadcast is host-to-host, so rank 0's async pipeline never waits on device work to send a plan, and a follower
waiting for the next plan holds no GPU stream.

Hazard: the followers block in `recv` while rank 0 does anything else (admitting rows, committing shards); the
group's timeout (groups.PLAN_TIMEOUT) bounds that wait, and a dead rank 0 leaves them there until the launcher
(or torchrun, or the Ray driver) ends them. Between BUILD and the end of rank 0's engine build the ranks are in
the build's own collectives on this group (Engine: agree_min); a STOP sent then would meet one of those and hang
or garble both, so a rank 0 that fails there sends nothing and its launcher ends the other ranks.
"""

from __future__ import annotations

import torch.distributed as dist

BUILD = "build"
STOP = "stop"

# the other ranks, as rank 0 knows them: waiting for BUILD or STOP (IDLE), building their engines after BUILD,
# in the engine build's collectives (BUILDING), following steps until STOP (SERVING), ended by STOP (STOPPED)
IDLE, BUILDING, SERVING, STOPPED = "idle", "building", "serving", "stopped"


class PlanChannel:
    def __init__(self, cpu_group, src_global_rank: int, is_leader: bool) -> None:
        self.group = cpu_group
        self.src = src_global_rank  # the group's rank 0, as a global rank (broadcast's `src`)
        self.is_leader = is_leader
        self.state = IDLE  # what the other ranks do now: IDLE, BUILDING, SERVING or STOPPED (below)
        self.num_steps_sent = 0

    def _send(self, message) -> None:
        assert self.is_leader, "only rank 0 of a tensor-parallel group sends plans"
        dist.broadcast_object_list([message], src=self.src, group=self.group)

    def send_build(self) -> None:
        self._send(BUILD)
        self.state = BUILDING

    def engine_built(self) -> None:
        """Rank 0's engine is built: every collective of the build is behind every rank, so each now waits in
        `recv` (or soon will) and a STOP reaches it."""
        if self.state == BUILDING:
            self.state = SERVING

    def send_step(self, batch) -> None:
        self._send(batch)
        self.num_steps_sent += 1

    def send_stop(self) -> None:
        self._send(STOP)
        self.state = STOPPED

    def release_followers(self) -> bool:
        """Rank 0 at its end: STOP to the other ranks if they wait for one (no engine was built: a refused or
        finished job; or the engine is built and not closed). False when they cannot be told: rank 0 failed
        while the ranks built their engines (see the module's hazard), or a rank is gone; their launcher (Ray:
        the driver) ends them, and rank 0's own error stands."""
        if self.state == STOPPED:
            return True
        if self.state == BUILDING:
            return False
        try:
            self.send_stop()
        except Exception:
            return False
        return True

    def recv(self):
        """The next message from rank 0: BUILD, STOP, or a ScheduledBatch."""
        assert not self.is_leader
        box = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

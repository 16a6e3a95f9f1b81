"""`batchgen run JOB --ray`: the driver. It prepares the output directory once (output_dir.py), cuts the source
into units (units.py), starts one RayWorker actor per worker (a Slot: slot.py) and deals units to them as they ask
for more; an actor that dies is replaced and its unfinished units are dealt again (with `recheck`, so what it
committed is skipped).

Exactly once rests on the commit protocol, as for any batchgen worker: each actor commits its rows under its own
tag, every row key is read before rows are generated, and a unit is with one live actor at a time.
The work queue lives here; units travel by Ray calls (`deal`), progress by `poll`.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

from batchgen.config import JobSpec
from batchgen.errors import JobError
from batchgen.job.result import RunResult
from batchgen.job.run import StopFlag
from batchgen.ray import cluster
from batchgen.ray.output_dir import job_result, prepare_output
from batchgen.ray.ranks import RankGroup, RayRank
from batchgen.ray.slot import RankFailed, Slot, bundle, first_line, is_job_error, kill, rank_error
from batchgen.ray.units import Unit, plan_units, unit_rows_for
from batchgen.sources import open_source, refuse_ignored_keys
from batchgen.job.run import check_keys_before_any_row
from batchgen.job.validate import refuse_changed_resume

POLL_INTERVAL_S = 0.25  # how often the driver asks each worker for progress (a worker queues ~2 steps of rows ahead)
MAX_FAILURES_PER_SLOT = 3  # failures of one worker slot in a row, no unit committed between: the job stops
GROW_CHECK_S = 10.0  # --workers auto: how often the cluster is asked whether it grew
RANK_GRACE_S = 30.0  # how long a tensor-parallel worker's other ranks may take to end after its rank 0 returned
# a worker the cluster has not placed (its GPUs / CPUs taken, a node lost): said after PLACE_WARN_S; when no worker
# at all is placed after PLACE_TIMEOUT_S (an autoscaler's new nodes take minutes) the job stops with a JobError
PLACE_WARN_S = 60.0
PLACE_TIMEOUT_S = 900.0
# the driver's settings its workers take along: batchgen's own (cache folder, fault injection) and offline switches
FORWARDED_ENV = ("BATCHGEN_", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


class RayJob:
    def __init__(self, spec: JobSpec, *, workers: int | str, fresh: bool = False, show_progress: bool = True,
                 job_file: Path | None = None) -> None:
        self.spec, self.workers_arg, self.fresh, self.show_progress = spec, workers, fresh, show_progress
        self.job_file = job_file
        self.ray = cluster.import_ray()
        self.out_dir = Path(spec.output.dir).resolve()
        self.dealer = f"ray {socket.gethostname()}:{os.getpid()}"
        self.slots: list[Slot] = []
        self.queue: deque[Unit] = deque()
        self.num_units_done_rows = 0
        self.stopping = self.finishing = False
        self.all_dealt_sent = False  # the live workers were told the queue is empty (refilled: told again later)
        self.placed_at = time.monotonic()  # the last moment a live worker was known placed (or the start)
        self.base_tokens = 0  # tokens of replaced actors (their counters died with them)
        self.started_ray = False
        self.remote_class = self.rank_class = None
        self.committed_before = (0, 0)  # (rows, rejects) the output held when this run started

    # ---- set-up ---------------------------------------------------------------------------------
    def _plan(self, num_slots: int, num_rows: int | None) -> int:
        """The work queue's units; `num_rows`: the source's rows when the key scan counted them."""
        if num_rows is None:
            source = open_source(self.spec.source)
            num_rows = source.expected_rows
            if num_rows is None:
                num_rows = sum(1 for _ in source)
        unit_rows = self.spec.source.worker_unit_rows or unit_rows_for(num_rows, num_slots)
        self.queue.extend(plan_units(num_rows, unit_rows))
        return num_rows

    def _start_actor(self, index: int, failures: int = 0) -> Slot:
        """Worker `index`: its RayWorker, and with tensor parallelism its other ranks in one placement group."""
        if self.remote_class is None:  # threads: `run` holds one for the job; deal/poll/finish/stop use the others
            env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
            options = {"runtime_env": {"env_vars": env}} if env else {}
            self.remote_class = self.ray.remote(max_concurrency=4, **options, **self.resources)(_actor_class())
            self.rank_class = self.ray.remote(**options, **self.resources)(RayRank)
        spec = self.spec
        if "num_gpus" in self.resources and spec.model.device.startswith("cuda:"):  # an actor sees its GPU alone
            spec = spec.model_copy(update={"model": spec.model.model_copy(update={"device": "cuda"})})
        spec_data = spec.model_dump(by_alias=True)
        size = spec.engine.tensor_parallel_size
        group = RankGroup(size, bundle(self.resources)) if size > 1 else None
        slot = Slot(index, None, None, failures=failures, group=group)
        try:
            placed = group.options(0) if group else {}
            slot.actor = self.remote_class.options(**placed).remote(spec_data, index, max(self.num_slots, index + 1),
                                                                    self.dealer)
            address = slot.actor.rendezvous.remote() if group else None  # Ray resolves it before each rank's run
            slot.run_ref = slot.actor.run.remote(address)
            if group:
                slot.ranks = [self.rank_class.options(**group.options(r)).remote(spec_data, r) for r in range(1, size)]
                slot.rank_refs = {r: a.run.remote(address) for r, a in enumerate(slot.ranks, start=1)}
            slot.poll_ref = slot.actor.poll.remote()
        except BaseException:
            kill(self.ray, slot)  # what was started of it, and its placement group
            raise
        return slot

    # ---- the run --------------------------------------------------------------------------------
    def run(self) -> RunResult:
        size = self.spec.engine.tensor_parallel_size
        if size > 1:
            from batchgen.job.ranks import check_before_launch

            check_before_launch(self.spec, model_elsewhere=True)  # from the model's config alone, before Ray starts
        refuse_ignored_keys(self.spec.source)
        _check_columns(self.spec)  # before the output is prepared: a refusal then leaves no folder behind
        scanned_rows = check_keys_before_any_row(self.spec)  # each actor sees only the units it is dealt
        if not self.fresh:
            refuse_changed_resume(self.spec)  # what the actors would refuse, said before Ray starts
        self.started_ray = cluster.connect(self.ray, self.workers_arg, size)
        try:
            self.num_slots, self.resources = cluster.plan_workers(self.ray, self.spec, self.workers_arg)
            self.committed_before = prepare_output(self.spec, self.out_dir, self.job_file, self.fresh,
                                                  self.num_slots)
            num_rows = self._plan(self.num_slots, scanned_rows)
            workers = f"{self.num_slots} worker{'s' if self.num_slots != 1 else ''}"
            each = self._each()
            unit_rows = self.queue[0].num_rows if self.queue else 0
            print(f"batchgen: Ray: {workers} ({each} each), {len(self.queue)} units of up to {unit_rows} rows",
                  file=sys.stderr)
            started = time.monotonic()
            for i in range(self.num_slots):
                self.slots.append(self._start_actor(i))
            with StopFlag() as stop, cluster.Progress(num_rows, self.show_progress) as progress:
                self._drive(stop, progress)
            return job_result(self.spec, self.out_dir, self.slots, base_tokens=self.base_tokens,
                              committed_before=self.committed_before, dealer=self.dealer,
                              wall_s=time.monotonic() - started, signum=stop.signum)
        finally:
            try:
                self._release_groups()
            finally:
                if self.started_ray:
                    self.ray.shutdown()

    def _drive(self, stop: StopFlag, progress) -> None:
        last_grow = time.monotonic()
        while not all(s.finished for s in self.slots):
            if stop.signum is not None and not self.stopping:
                self.stopping = True
                for s in self._live():
                    s.actor.stop.remote(stop.signum)
            self._collect_runs()
            self._collect_polls()
            if self.stopping or self.finishing:
                self._let_go_unplaced()
            else:
                self._check_placement()
            if not self.stopping:
                self._deal()
                if not self.queue and not any(s.held for s in self._live()) and not self.finishing:
                    self.finishing = True
                    for s in self._live():
                        s.actor.finish.remote()
                if self.workers_arg == "auto" and time.monotonic() - last_grow >= GROW_CHECK_S:
                    last_grow = time.monotonic()
                    self._grow()
            progress.show(self.num_units_done_rows, self.base_tokens + sum(s.generated_tokens for s in self.slots))
            time.sleep(POLL_INTERVAL_S)

    def _live(self) -> list[Slot]:
        return [s for s in self.slots if not s.finished]

    def _collect_runs(self) -> None:
        """Each worker's run call, once it returned: its result, or its failure. Rank 0's outcome comes first (a
        finished result stands; its JobError is the job's); a failed rank of a tensor-parallel worker fails the
        worker (rank 0 would wait for it in a collective), named beside rank 0's error when both failed."""
        for s in self._live():
            error_of_rank = rank_error(self.ray, s)
            ready, _ = self.ray.wait([s.run_ref], timeout=0)
            if ready:
                try:
                    s.result = self.ray.get(s.run_ref)
                    s.finished = True
                    continue
                except Exception as e:
                    # both failed: which first is unknown (a rank's end breaks the others' collectives), so
                    # both are said; a JobError stands alone
                    self._failed(s, e, also=None if is_job_error(e) else error_of_rank)
                    continue
            if error_of_rank is not None:
                self._failed(s, error_of_rank)

    def _collect_polls(self) -> None:
        for s in self._live():
            ready, _ = self.ray.wait([s.poll_ref], timeout=0)
            if not ready:
                continue
            try:
                state = self.ray.get(s.poll_ref)
            except Exception as e:
                self._failed(s, e)
                continue
            for unit_id in state["done"]:
                unit = s.held.pop(unit_id)
                self.num_units_done_rows += unit.num_rows
                s.failures = 0
            s.placed, s.started = True, state["started"]
            self.placed_at = time.monotonic()
            s.num_unread_rows, s.num_queued_units = state["num_unread_rows"], state["num_queued_units"]
            s.num_wanted_rows, s.generated_tokens = state["num_wanted_rows"], state["generated_tokens"]
            s.poll_ref = s.actor.poll.remote()

    def _check_placement(self) -> None:
        """Say which workers wait for the cluster to place them; a JobError when none was placed in time."""
        waiting = [s for s in self._live() if not s.placed]
        if not waiting:
            return
        now = time.monotonic()
        size = self.spec.engine.tensor_parallel_size
        each = self._each() + (" on one node" if size > 1 else "")
        for s in waiting:
            if not s.said_waiting and now - s.created_at >= PLACE_WARN_S:
                s.said_waiting = True
                print(f"batchgen: Ray worker {s.index} waits for the cluster to place it ({each}); "
                      f"{cluster.describe_available(self.ray)}", file=sys.stderr)
        if len(waiting) == len(self._live()) and now - self.placed_at >= PLACE_TIMEOUT_S:
            self._stop_all()
            raise JobError(f"no Ray worker could be placed in {PLACE_TIMEOUT_S:.0f} s: each asks for {each}, and "
                           f"{cluster.describe_available(self.ray)}; free or add resources, or lower --workers "
                           f"(a rerun resumes)")

    def _let_go_unplaced(self) -> None:
        """Finishing (every unit committed or with a placed worker) or stopping: a worker still unplaced holds no
        unit and would never be given one, nor hear `finish` or `stop`, so it is let go rather than waited for."""
        for s in self._live():
            if not s.placed and not s.held:
                kill(self.ray, s)
                s.finished = True

    def _each(self) -> str:
        """What one worker asks of the cluster, in words: '1 GPU, 1 CPU' or '2 ranks of 1 GPU, 1 CPU'."""
        size = self.spec.engine.tensor_parallel_size
        return (f"{size} ranks of " if size > 1 else "") + cluster.describe_resources(self.resources)

    def _deal(self) -> None:
        """Give each started actor units until it has twice a step's rows queued and one unit beyond the one it
        reads: the engine stays full, and the rest of the queue stays with the driver for whoever frees up."""
        for s in self._live():
            if not s.started or s.result is not None:
                continue
            units = []
            while self.queue and (s.num_unread_rows < s.num_wanted_rows or s.num_queued_units == 0):
                unit = self.queue.popleft()
                units.append(unit)
                s.held[unit.unit_id] = unit
                s.num_unread_rows += unit.num_rows
                s.num_queued_units += 1
            if units:
                s.actor.deal.remote(units)
        if not self.queue and not self.all_dealt_sent:
            self.all_dealt_sent = True
            for s in self._live():
                s.actor.all_dealt.remote()

    def _failed(self, s: Slot, error: Exception, also: RankFailed | None = None) -> None:
        """A worker's run raised or its actor died (or one of its ranks: RankFailed; `also`: another rank's
        failure seen at the same time). A JobError (the job's settings or data) stops the job; any other failure
        replaces the worker and deals its unfinished units again."""
        rank = f"rank {error.rank}: " if isinstance(error, RankFailed) else ""
        error = error.error if isinstance(error, RankFailed) else error
        cause = getattr(error, "cause", error)
        if is_job_error(error):
            self._stop_all()
            raise JobError(f"worker {s.index} on Ray: {rank}{cause}") from None
        why = rank + first_line(error)
        if also is not None:
            why = f"rank 0: {why}; rank {also.rank}: {first_line(also.error)}"
        s.finished = True
        self.base_tokens += s.generated_tokens
        s.generated_tokens = 0
        kill(self.ray, s)
        lost = sorted(s.held.values(), key=lambda u: u.start)
        if self.stopping or (not lost and self.finishing):
            return  # stopping (its uncommitted rows are the next run's), or nothing of it is unfinished
        if s.failures + 1 >= MAX_FAILURES_PER_SLOT:
            self._stop_all()
            raise RuntimeError(f"worker {s.index} on Ray failed {s.failures + 1} times in a row with no unit "
                               f"committed between (the last: {why}); stopping: what is committed stays, a rerun "
                               f"resumes")
        self.queue.extendleft(reversed([replace(u, recheck=True) for u in lost]))
        self.all_dealt_sent = False
        print(f"batchgen: Ray worker {s.index} failed ({why}); starting a new one, its {len(lost)} unfinished "
              f"units are dealt again", file=sys.stderr)
        new = self._start_actor(s.index, failures=s.failures + 1)
        self.slots[self.slots.index(s)] = new
        if self.finishing:
            self.finishing = False  # its units are back in the queue: dealt, then every worker told again

    def _grow(self) -> None:
        target, _ = cluster.plan_workers(self.ray, self.spec, "auto")
        while len(self.slots) < target and self.queue:
            self.slots.append(self._start_actor(len(self.slots)))
            print(f"batchgen: the Ray cluster grew: worker {len(self.slots) - 1} started", file=sys.stderr)

    def _stop_all(self) -> None:
        for s in self._live():
            kill(self.ray, s)

    def _release_groups(self) -> None:
        """At the end: tensor-parallel ranks end at their rank 0's STOP; any still running after RANK_GRACE_S is
        killed, and every placement group is given back (on a long-lived cluster they would hold its GPUs)."""
        refs = [r for s in self.slots for r in s.rank_refs.values()]
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=RANK_GRACE_S)
        for s in self.slots:
            if s.group is not None:
                kill(self.ray, s)


def _check_columns(spec: JobSpec) -> None:
    """What run refuses from the source's columns before it writes anything (kept columns, the key column's name,
    source.sampling_column, sampling.response_format_column): refused here by the driver, before the output
    folder is made, not by the first actor after it was (the failed start's marker, locks and resolved job
    stayed, and status read them as killed workers)."""
    from batchgen.job.row_sampling import RowSampling
    from batchgen.output.schema import OutputSchema

    source = open_source(spec.source)
    OutputSchema.build(spec, source.schema)
    RowSampling(spec, source.columns)


def _actor_class():
    from batchgen.ray.worker import RayWorker

    return RayWorker


def run_on_ray(spec: JobSpec, *, workers: int | str, fresh: bool = False, show_progress: bool = True,
               job_file: Path | None = None) -> RunResult:
    return RayJob(spec, workers=workers, fresh=fresh, show_progress=show_progress, job_file=job_file).run()

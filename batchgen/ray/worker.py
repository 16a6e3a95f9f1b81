"""RayWorker: one batchgen worker inside a Ray actor. It writes through the usual commit protocol (its own
manifest and shards, tag w<slot>) into the shared output directory; its rows come from the units the driver
deals it (units.py).

The actor is threaded: `run` holds one thread for the whole job (set-up, then the JobLoop) while `deal`, `poll`,
`finish` and `stop` arrive on others. Nothing heavy happens in the constructor: its errors would surface as the
actor's death, while set-up errors in `run` come back as the call's exception (a JobError stays a JobError).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from batchgen.config import JobSpec
from batchgen.errors import JobError
from batchgen.job.loop import JobLoop
from batchgen.job.workers import WorkerInfo
from batchgen.output import layout
from batchgen.output import manifest as mf
from batchgen.output.lock import DirectoryLock, WorkerLock, check_partition
from batchgen.output.temp_file import write_text_atomic
from batchgen.ray.ranks import join_group, open_rendezvous
from batchgen.ray.units import Unit, UnitFeed

LOCK_WAIT_S = 30.0  # a replacement waits this long for its dead predecessor's lock to be let go


class _Stop:
    """The JobLoop's stop flag (job/run.py's StopFlag without signal handlers: the driver relays signals)."""

    signum: int | None = None


class RayWorker:
    def __init__(self, spec_data: dict, slot: int, num_slots: int, dealer: str) -> None:
        self.spec_data, self.slot, self.num_slots, self.dealer = spec_data, slot, num_slots, dealer
        self.feed = UnitFeed()
        self.stop_flag = _Stop()
        self.loop: JobLoop | None = None
        self.store = None  # a tensor-parallel worker's TCPStore (rendezvous), which its ranks meet at

    def rendezvous(self) -> str:
        """A tensor-parallel worker's meeting address, on this actor's node; its store is held for `run`
        (ranks.py)."""
        size = JobSpec.model_validate(self.spec_data).engine.tensor_parallel_size
        self.store, address = open_rendezvous(size)
        return address

    def run(self, address: str | None = None) -> dict:
        """Set up, generate the dealt units until `finish` (or `stop`), commit; the worker's report.
        `address`: a tensor-parallel worker's rendezvous (`rendezvous`; this actor is its rank 0), None without."""
        os.environ["BATCHGEN_WORKER_INDEX"] = str(self.slot)  # fault injection by worker (output/faults.py)
        spec = JobSpec.model_validate(self.spec_data)
        if address is None:
            return self._run(spec, None)
        from batchgen.distributed import groups
        from batchgen.job.ranks import check_before_launch

        check_before_launch(spec)  # the driver may not have seen the model: its ranks wait, the driver ends them
        tp, spec = join_group(spec, address, 0, self.store)
        try:
            return self._run(spec, tp)
        finally:
            tp.plans.release_followers()
            groups.destroy()
            self.store = None

    def _run(self, spec: JobSpec, tp) -> dict:
        out_dir = Path(spec.output.dir)
        if not (out_dir / layout.MARKER_FILE).is_file():  # the driver wrote it before starting any worker
            raise JobError(f"the output directory {out_dir} is not visible from the Ray node {socket.gethostname()} "
                           f"(the driver created it, this worker cannot see it): output.dir must be a path every "
                           f"node of the cluster sees (a shared file system such as NFS or Lustre)")
        tag = mf.worker_tag(self.slot)
        lock = self._take_lock(out_dir, tag)
        try:
            with DirectoryLock(out_dir):
                check_partition(out_dir, lock)
            self.loop = loop = JobLoop(spec, out_dir, WorkerInfo(self.slot, self.num_slots, source="ray"),
                                       show_progress=False, tensor_parallel=tp, dealt=True)
            self.feed.attach(loop.source, loop.refresh_done_keys)
            loop.use_feed(self.feed)
            result = loop.run(self.stop_flag)
            reports = out_dir / "reports"
            reports.mkdir(exist_ok=True)
            write_text_atomic(reports / f"{tag}.json", json.dumps(result.report, indent=2))
            lock.remove()
            return {"slot": self.slot, "rows_committed": result.rows_committed, "rows_rejected": result.rows_rejected,
                    "rows_skipped": result.rows_skipped, "interrupted_by": result.interrupted_by,
                    "report": result.report}
        finally:
            lock.release()

    def _take_lock(self, out_dir: Path, tag: str) -> WorkerLock:
        """This slot's worker lock; a replaced worker's process may take a moment to let it go."""
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                return WorkerLock(out_dir, tag, dealer=self.dealer)
            except JobError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    def deal(self, units: list[Unit]) -> None:
        self.feed.deal(units)

    def poll(self) -> dict:
        """What the driver deals and shows by: units committed since the last poll, rows not yet read, how
        many rows this worker wants queued (twice what its engine runs at once), its counters."""
        state = self.feed.poll()
        loop = self.loop
        if loop is None:
            return {**state, "started": False, "num_wanted_rows": 0, "rows_done": 0, "generated_tokens": 0}
        engine = loop.engine
        max_num_seqs = engine.scheduler.max_num_seqs if engine is not None else int(loop.spec.engine.max_num_seqs)
        t = loop.meter.totals
        return {**state, "started": True, "num_wanted_rows": 2 * max_num_seqs, "rows_done": t.rows_done,
                "generated_tokens": t.generated_tokens}

    def all_dealt(self) -> None:
        """The driver's queue is empty: what this worker holds is the job's tail (units.py)."""
        self.feed.mark_all_dealt()

    def finish(self) -> None:
        """No more units: generate what is dealt, commit, return from `run`."""
        self.feed.close()

    def stop(self, signum: int) -> None:
        """Stop admitting, commit the finished rows, return from `run` as interrupted."""
        self.stop_flag.signum = signum
        self.feed.close()

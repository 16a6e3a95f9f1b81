"""Workers: which part of the rows this process generates, and who it is in a cluster job.

Identity comes from --worker-index/--num-workers, else from the scheduler's environment: a Slurm job array
(SLURM_ARRAY_TASK_ID with SLURM_ARRAY_TASK_COUNT, or MIN/MAX), torchrun (RANK/WORLD_SIZE; LOCAL_RANK picks
the GPU), or a Kubernetes indexed job (JOB_COMPLETION_INDEX with BATCHGEN_NUM_WORKERS). Flags win over the
environment; two environments that disagree are an error.

Partition: rows are dealt to workers in units of `unit_rows` consecutive rows, round-robin, so each worker
reads its source sequentially and computes its part alone, with no coordinator. Unless the job sets
source.worker_unit_rows, the unit is sized from the source's row count (`sized_for`): every worker of a run
computes it from the same source, so all of them deal the rows alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import islice

from batchgen.errors import JobError

DEFAULT_UNIT_ROWS = 1024


@dataclass(frozen=True)
class WorkerInfo:
    index: int
    count: int
    unit_rows: int = DEFAULT_UNIT_ROWS
    source: str = "default"  # where the identity came from, for messages
    local_rank: int | None = None  # the GPU to use, when the launcher says so
    num_rows: int | None = None  # the source's row count the partition was sized from (None: not counted)
    unit_rows_from_job: bool = False  # unit_rows was set by source.worker_unit_rows (not sized automatically)

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise JobError(f"worker index {self.index} is not in [0, {self.count}) (from {self.source})")
        if self.unit_rows < 1:
            raise JobError(f"source.worker_unit_rows must be >= 1, got {self.unit_rows}")

    def owns(self, position: int) -> bool:
        return (position // self.unit_rows) % self.count == self.index

    def num_owned(self, num_rows: int) -> int:
        """How many of positions 0..num_rows-1 this worker owns (without walking them)."""
        full_units, tail = divmod(num_rows, self.unit_rows)
        rounds, extra = divmod(full_units, self.count)
        owned = rounds * self.unit_rows + (self.unit_rows if self.index < extra else 0)
        return owned + (tail if self.index == extra else 0)

    def sized_for(self, unit_rows: int | None, source) -> WorkerInfo:
        """The partition for a Source: `unit_rows` as the job sets it, else sized from its row count so that
        every worker gets rows. A count the source does not know (JSONL) is read, up to count *
        DEFAULT_UNIT_ROWS rows: beyond that the default unit gives every worker rows anyway."""
        rows = source.expected_rows if source.num_rows is not None else None  # exact, or not known
        if unit_rows is not None:
            return replace(self, unit_rows=unit_rows, num_rows=rows, unit_rows_from_job=True)
        if rows is None and self.count > 1:
            cap = self.count * DEFAULT_UNIT_ROWS
            counted = sum(1 for _ in islice(source, cap))
            rows = counted if counted < cap else None
        return replace(self, unit_rows=auto_unit_rows(rows, self.count), num_rows=rows)

    def why_no_rows(self) -> str:
        """Why this worker owns no row (for its one line of output)."""
        me = f"worker {self.index} of {self.count} has no rows"
        if self.unit_rows_from_job:
            size = f"the source's {self.num_rows} rows" if self.num_rows is not None else "the source's rows"
            return (f"{me}: {size} are dealt in units of source.worker_unit_rows = {self.unit_rows} and none "
                    f"fell to it; lower source.worker_unit_rows (or remove it: sized automatically) or start "
                    f"fewer workers")
        return f"{me}: the source has {self.num_rows} rows for {self.count} workers; start at most {self.num_rows}"


def auto_unit_rows(num_rows: int | None, count: int) -> int:
    """A deterministic unit from (rows, workers): floor(rows / workers), so there are at least `count` units
    whenever rows >= count (ceil would leave a worker empty: 9 rows, 4 workers -> 3 units of 3), capped at
    DEFAULT_UNIT_ROWS (sequential reads per worker); DEFAULT_UNIT_ROWS when the count is unknown or large."""
    if num_rows is None:
        return DEFAULT_UNIT_ROWS
    return max(1, min(DEFAULT_UNIT_ROWS, num_rows // count))


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise JobError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _slurm_array_part(env: Mapping[str, str], task: int) -> tuple[int, int]:
    """(index, count) of a Slurm array task from SLURM_ARRAY_TASK_MIN / MAX / STEP (and COUNT, which Slurm sets
    too). An array whose task ids are not one range with a step (`--array=3,5`, a resubmission of failed tasks)
    cannot say which part each task is: a JobError, as dealing by the ids left parts to no task (each task exited 0,
    rows never generated)."""
    lo, hi = _int(env, "SLURM_ARRAY_TASK_MIN"), _int(env, "SLURM_ARRAY_TASK_MAX")
    step = _int(env, "SLURM_ARRAY_TASK_STEP") if "SLURM_ARRAY_TASK_STEP" in env else 1
    count = (hi - lo) // step + 1 if step > 0 else 0
    given = _int(env, "SLURM_ARRAY_TASK_COUNT") if "SLURM_ARRAY_TASK_COUNT" in env else count
    if step < 1 or given != count or (task - lo) % step or not lo <= task <= hi:
        raise JobError(f"this Slurm array's task ids (SLURM_ARRAY_TASK_MIN {lo}, MAX {hi}, STEP {step}, COUNT {given}) "
                       f"are not one range with a step, so no task can tell which part of the rows is its own. "
                       f"Submit the array as --array=0-N (any size resumes what is committed), or pass "
                       f"--worker-index and --num-workers")
    return (task - lo) // step, count


def _from_environment(env: Mapping[str, str], count: int | None) -> list[tuple[str, int, int, int | None]]:
    found = []
    if "SLURM_ARRAY_TASK_ID" in env:
        task = _int(env, "SLURM_ARRAY_TASK_ID")
        if "SLURM_ARRAY_TASK_COUNT" in env and "SLURM_ARRAY_TASK_MIN" not in env:
            found.append(("Slurm array", task, _int(env, "SLURM_ARRAY_TASK_COUNT"), None))
        elif "SLURM_ARRAY_TASK_MIN" in env and "SLURM_ARRAY_TASK_MAX" in env:
            found.append(("Slurm array", *_slurm_array_part(env, task), None))
        else:
            raise JobError("SLURM_ARRAY_TASK_ID is set without SLURM_ARRAY_TASK_COUNT or MIN/MAX; pass "
                           "--worker-index and --num-workers")
    if "RANK" in env and "WORLD_SIZE" in env:
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else None
        found.append(("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"), local))
    if "JOB_COMPLETION_INDEX" in env:
        if count is not None:
            found.append(("Kubernetes indexed job", _int(env, "JOB_COMPLETION_INDEX"), count, None))
        elif "BATCHGEN_NUM_WORKERS" not in env:
            raise JobError("JOB_COMPLETION_INDEX (Kubernetes indexed job) is set but the worker count is not: set "
                           "BATCHGEN_NUM_WORKERS to the job's completions, or pass --num-workers")
        else:
            found.append(("Kubernetes indexed job", _int(env, "JOB_COMPLETION_INDEX"),
                          _int(env, "BATCHGEN_NUM_WORKERS"), None))
    return found


def resolve_worker(index: int | None, count: int | None, env: Mapping[str, str] | None = None) -> WorkerInfo:
    env = os.environ if env is None else env
    if index is not None and count is not None:
        return WorkerInfo(index, count, source="--worker-index/--num-workers")
    if index is not None:
        raise JobError("--worker-index needs --num-workers")
    found = _from_environment(env, count)
    if count is not None:  # --num-workers alone: the index must come from the environment
        found = [(name, i, count, lr) for name, i, _, lr in found]
        if not found:
            raise JobError("--num-workers needs --worker-index (or a scheduler variable such as "
                           "SLURM_ARRAY_TASK_ID, RANK or JOB_COMPLETION_INDEX)")
    if not found:
        return WorkerInfo(0, 1)
    if len({(i, c) for _, i, c, _ in found}) > 1:
        described = "; ".join(f"{name}: worker {i} of {c}" for name, i, c, _ in found)
        raise JobError(f"the environment names conflicting worker identities ({described}); pass --worker-index "
                       f"and --num-workers to choose")
    name, i, c, local = found[0]
    local = next((lr for _, _, _, lr in found if lr is not None), local)
    return WorkerInfo(i, c, source=name, local_rank=local)

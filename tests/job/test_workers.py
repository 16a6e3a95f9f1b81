"""Worker identity from flags and each scheduler's environment; the partition is exact and balanced."""

from __future__ import annotations

import pytest

from batchgen.errors import JobError
from batchgen.job.workers import WorkerInfo, resolve_worker


@pytest.mark.parametrize("env,expected", [
    ({}, (0, 1)),
    ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "8"}, (3, 8)),
    ({"SLURM_ARRAY_TASK_ID": "12", "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_MAX": "13"}, (2, 4)),
    # what sbatch --array=0-6:2 sets (Slurm sets COUNT beside MIN / MAX / STEP): task 4 is the third of four
    ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "0",
      "SLURM_ARRAY_TASK_MAX": "6", "SLURM_ARRAY_TASK_STEP": "2"}, (2, 4)),
    ({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_MIN": "0",
      "SLURM_ARRAY_TASK_MAX": "7", "SLURM_ARRAY_TASK_STEP": "1"}, (7, 8)),
    ({"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1"}, (5, 6)),
    ({"JOB_COMPLETION_INDEX": "2", "BATCHGEN_NUM_WORKERS": "4"}, (2, 4)),
    ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"}, (1, 2)),  # agree
])
def test_identity_from_scheduler_environment(env, expected):
    w = resolve_worker(None, None, env)
    assert (w.index, w.count) == expected


def test_torchrun_local_rank_picks_the_gpu():
    assert resolve_worker(None, None, {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1"}).local_rank == 1


def test_flags_win_over_the_environment():
    w = resolve_worker(1, 3, {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "8"})
    assert (w.index, w.count) == (1, 3)
    assert (resolve_worker(None, 5, {"JOB_COMPLETION_INDEX": "4"}).index,) == (4,)


@pytest.mark.parametrize("env,flags,message", [
    ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"}, (None, None),
     "conflicting worker identities (Slurm array: worker 1 of 2; torchrun: worker 0 of 2)"),
    ({"JOB_COMPLETION_INDEX": "1"}, (None, None), "set BATCHGEN_NUM_WORKERS"),
    ({"SLURM_ARRAY_TASK_ID": "1"}, (None, None), "without SLURM_ARRAY_TASK_COUNT"),
    # --array=3,5 (resubmitting failed tasks): ids that are no range with a step leave parts to no task
    ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_MIN": "3",
      "SLURM_ARRAY_TASK_MAX": "5", "SLURM_ARRAY_TASK_STEP": "1"}, (None, None), "are not one range with a step"),
    ({}, (2, None), "--worker-index needs --num-workers"),
    ({}, (None, 2), "--num-workers needs --worker-index"),
    ({}, (3, 3), "worker index 3 is not in [0, 3)"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, (None, None), "RANK='x' is not an integer"),
])
def test_bad_or_conflicting_identities_are_errors(env, flags, message):
    with pytest.raises(JobError, match=None) as err:
        resolve_worker(*flags, env)
    assert message in str(err.value)


def test_partition_gives_every_row_to_exactly_one_worker_in_contiguous_units():
    workers = [WorkerInfo(i, 3, unit_rows=4) for i in range(3)]
    owners = [[w.index for w in workers if w.owns(p)] for p in range(100)]
    assert all(len(o) == 1 for o in owners)
    assert [o[0] for o in owners[:12]] == [0] * 4 + [1] * 4 + [2] * 4


def test_num_owned_counts_each_workers_part_without_walking_the_rows():
    for count, unit, rows in [(3, 4, 100), (1, 1024, 7), (4, 5, 21), (2, 3, 6)]:
        workers = [WorkerInfo(i, count, unit_rows=unit) for i in range(count)]
        assert [w.num_owned(rows) for w in workers] == [sum(w.owns(p) for p in range(rows)) for w in workers]

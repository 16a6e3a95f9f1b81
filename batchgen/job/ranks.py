"""A tensor-parallel job (engine.tensor_parallel_size N > 1): the checks made before any rank starts or any
weight loads, which GPUs each worker's ranks get, and what each rank process runs.

Process model: every worker (data-parallel part of the rows, job/workers.py) is a group of N rank processes.
Rank 0 runs the whole job as a one-process worker would (source, engine with its scheduler, shards, manifest,
logs, report) and drives the others through distributed/plan.py; ranks 1..N-1 read no row and write no file:
they wait for BUILD, load their shard, build their engine and follow rank 0's steps until STOP. Started by
`batchgen run` itself (job/launcher.py: each group its own localhost world and free port) or by torchrun
(global rank g = rank g % N of worker g // N).
"""

from __future__ import annotations

import signal
import threading

from batchgen.errors import JobError
from batchgen.config import JobSpec
from batchgen.job.workers import WorkerInfo


def check_before_launch(spec: JobSpec, *, model_elsewhere: bool = False) -> None:
    """JobError naming the key when this job cannot run split engine.tensor_parallel_size ways, from the model's
    config alone (no weight is read): heads, KV heads or MLP columns it does not divide, a model without a
    sharded fused decoder, a device that names one GPU. model_elsewhere (the Ray driver, which may not see a
    model path local to the cluster's nodes): a model this process cannot read skips the config checks (each
    worker makes them again before its ranks meet)."""
    size = spec.engine.tensor_parallel_size
    if size == 1:
        return
    if spec.model.device.startswith("cuda:"):
        raise JobError(f"model.device {spec.model.device!r} names one GPU, but engine.tensor_parallel_size {size} "
                       f"gives each rank its own; set model.device: auto (or cuda)")
    if spec.sampling.response_format is not None or spec.sampling.response_format_column is not None:
        raise JobError(f"sampling.response_format (or response_format_column) with engine.tensor_parallel_size "
                       f"{size}: structured output is not supported with tensor parallelism yet (its grammar "
                       f"masks live on rank 0); run it with tensor_parallel_size 1")
    from batchgen.job.validate import tokenizer_and_config
    from batchgen.models.registry import tensor_parallel_reason

    try:
        _, config = tokenizer_and_config(spec)
    except JobError:
        if model_elsewhere:
            return
        raise
    reason = tensor_parallel_reason(config, size)
    if reason is not None:
        raise JobError(f"engine.tensor_parallel_size {size}: {reason}")


def worker_gpus(spec: JobSpec, num_workers: int, gpus: list[int] | None, gpus_flag: str | None,
                num_available: int) -> list[int] | None:
    """The GPU ids of every rank, worker after worker (worker w's ranks: [w N, (w + 1) N)), or None for CPU
    ranks. `gpus`: what --gpus resolved to (then the workers are len(gpus) / N)."""
    size = spec.engine.tensor_parallel_size
    if gpus is not None:
        if len(gpus) % size:
            raise JobError(f"--gpus {gpus_flag} with engine.tensor_parallel_size {size}: each worker takes {size} "
                           f"GPUs, so --gpus must be a multiple of {size} (this machine has {num_available} visible)")
        return gpus
    device = spec.model.device
    if device == "cpu" or (device == "auto" and num_available == 0):
        return None
    need = num_workers * size
    if need > num_available:
        raise JobError(f"engine.tensor_parallel_size {size} x {num_workers} worker(s) needs {need} GPUs; this "
                       f"machine has {num_available} visible (lower the workers or the tensor-parallel size)")
    return list(range(need))


def torchrun_worker(identity) -> WorkerInfo:
    """Under torchrun, the data-parallel worker of this rank's group."""
    return WorkerInfo(identity.group_index, identity.num_groups, source="torchrun (tensor-parallel groups)")


def run_rank(spec: JobSpec, identity, worker: WorkerInfo, fresh: bool, show_progress: bool, job_file=None):
    """This process's part of the job: rank 0 returns the worker's RunResult, the other ranks None."""
    from batchgen.distributed import groups
    from batchgen.job.run import run_job
    from batchgen.runner.loader import resolve_device

    device = resolve_device(spec.model.device)
    tp = groups.init_tensor_parallel(identity, device.type)
    if device.type == "cuda":  # this rank's own GPU
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={"device": str(tp.device)})})
    try:
        if not tp.is_leader:
            follow_job(spec, tp)
            return None
        try:
            return run_job(spec, fresh=fresh, worker=worker, show_progress=show_progress, tensor_parallel=tp,
                           job_file=job_file)
        finally:
            tp.plans.release_followers()
    finally:
        groups.destroy()


def follow_job(spec: JobSpec, tp) -> None:
    """A rank > 0: wait for BUILD, load this rank's shard, build the engine, run rank 0's steps until STOP.
    Signals are rank 0's to act on (it finishes the step in flight, which needs every rank, then commits and
    sends STOP), so this process ignores SIGINT and SIGTERM; a rank 0 that dies is the launcher's to clean up."""
    from batchgen.distributed.follower import follow
    from batchgen.distributed.plan import BUILD, STOP
    from batchgen.engine.engine import Engine
    from batchgen.runner.loader import load_model, model_source

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # rank 0 shows the job's progress
    if threading.current_thread() is threading.main_thread():  # a Ray actor's call may run on another thread
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
    message = tp.plans.recv()
    if message == STOP:
        return
    if message != BUILD:
        raise RuntimeError(f"tensor-parallel rank {tp.rank}: expected BUILD or STOP from rank 0, got {type(message)}")
    model = load_model(model_source(spec.model.path, spec.model.gguf_file), spec.model.dtype, spec.model.device,
                       shard=(tp.rank, tp.size))
    engine = Engine(model, None, spec.engine, tensor_parallel=tp)
    try:
        follow(engine.runner, tp.plans)
    finally:
        engine.close()

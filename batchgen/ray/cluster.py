"""The Ray cluster as the driver sees it: connecting, how many workers it holds and what each asks for, and the
driver's progress bar."""

from __future__ import annotations

import os
import time

from tqdm import tqdm

from batchgen.config import JobSpec
from batchgen.errors import JobError

RESOURCE_NAMES = {"num_gpus": "GPU", "num_cpus": "CPU"}  # an actor's options -> Ray's resource names
INSTALL_HINT = "pip install 'batchgen[ray]' (or pip install 'ray[data]')"


def import_ray():
    """The ray module, or a JobError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise JobError(f"--ray needs Ray, which is not installed here: {INSTALL_HINT}") from None
    return ray


def connect(ray, workers: int | str, ranks_per_worker: int = 1) -> bool:
    """Join the cluster in RAY_ADDRESS, or start a local Ray instance (one already running in this process is
    used as it is). A local instance offers a CPU slot per rank asked for even beyond the machine's cores (CPU
    workers share them). True when this call started Ray (the driver then shuts it down)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or None
    local = {} if address is not None or workers == "auto" else \
        {"num_cpus": max(os.cpu_count() or 1, int(workers) * ranks_per_worker)}
    try:
        # without RAY_ADDRESS, "local": a new local instance (Ray's own default would join any instance it finds
        # on this machine, and refuse num_cpus there with a ValueError)
        ray.init(address=address or "local", include_dashboard=False, configure_logging=False, log_to_driver=True,
                 **local)
    except ConnectionError as e:
        raise JobError(f"cannot connect to the Ray cluster at RAY_ADDRESS={address}: {e}") from None
    return True


def _gpu_job(spec: JobSpec, num_gpus: int) -> bool:
    device = spec.model.device
    if device == "cpu":
        return False
    if device.startswith("cuda"):
        return True
    return num_gpus > 0  # auto: GPUs where the cluster has them


def plan_workers(ray, spec: JobSpec, workers: int | str) -> tuple[int, dict]:
    """(how many workers, the Ray resources of each rank). A worker is engine.tensor_parallel_size ranks on one
    node, each taking a GPU, or one CPU on a cluster without GPUs (or model.device: cpu). `workers` "auto": as
    many as the cluster holds."""
    resources = ray.cluster_resources()
    num_gpus, num_cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    size = spec.engine.tensor_parallel_size
    if _gpu_job(spec, num_gpus):
        if num_gpus == 0:
            raise JobError(f"model.device is {spec.model.device!r} but the Ray cluster has no GPU (it has "
                           f"{num_cpus} CPUs); set model.device: auto or cpu, or add GPU nodes")
        each, key, have, what = {"num_gpus": 1, "num_cpus": 1}, "GPU", num_gpus, "GPUs"
    else:
        each, key, have, what = {"num_cpus": 1}, "CPU", num_cpus, "CPUs"
    if size > 1:  # a worker's ranks share one node: count what each node holds whole
        per_node = sorted((int(n["Resources"].get(key, 0)) for n in ray.nodes() if n.get("Alive")), reverse=True)
        have = sum(c // size for c in per_node)
    count = have if workers == "auto" else int(workers)
    if count < 1:
        raise JobError(f"--workers must be >= 1 (the Ray cluster has {num_gpus} GPUs and {num_cpus} CPUs)" +
                       (f", and engine.tensor_parallel_size {size} needs {size} {what} on one node for a worker; "
                        f"its nodes have {', '.join(map(str, per_node))}" if size > 1 else ""))
    if count > have and size > 1:
        raise JobError(f"--workers {count} with engine.tensor_parallel_size {size} needs {count} nodes' worth of "
                       f"{size} {what} on one node each, but the Ray cluster's nodes have "
                       f"{', '.join(map(str, per_node))} {what}: room for {have}; start at most {have} workers, "
                       f"or --workers auto")
    if count > have:
        raise JobError(f"--workers {count} needs {count} {what} (one each) but the Ray cluster has {have} "
                       f"({num_gpus} GPUs, {num_cpus} CPUs); start at most {have} workers, or --workers auto")
    return count, each


def describe_resources(each: dict) -> str:
    return ", ".join(f"{v} {RESOURCE_NAMES[k]}" for k, v in each.items())


def describe_available(ray) -> str:
    """What the cluster has free now of what it has, in words: 'the cluster has 0 of 4 CPUs free'."""
    total, free = ray.cluster_resources(), ray.available_resources()
    parts = [f"{free.get(name, 0):g} of {total[name]:g} {name}s" for name in ("GPU", "CPU") if total.get(name)]
    return f"the cluster has {' and '.join(parts) or 'no GPU or CPU'} free"


class Progress:
    """One bar over every worker: rows of committed units, and the generation rate."""

    def __init__(self, num_rows: int, show: bool) -> None:
        self._bar = tqdm(total=num_rows, unit="row", dynamic_ncols=True, disable=not show, desc="ray")
        self._started = time.monotonic()

    def __enter__(self) -> Progress:
        return self

    def show(self, rows_done: int, generated_tokens: int) -> None:
        if rows_done > self._bar.n:
            self._bar.update(rows_done - self._bar.n)
        rate = generated_tokens / max(time.monotonic() - self._started, 1e-9)
        self._bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)

    def __exit__(self, *exc) -> None:
        self._bar.close()

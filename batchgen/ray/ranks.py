"""A tensor-parallel Ray worker (engine.tensor_parallel_size T > 1): one placement group of T bundles on one node
(STRICT_PACK), the worker's RayWorker (rank 0, which runs the JobLoop and writes the output) in bundle 0 and a
RayRank (ranks 1..T-1, which load their shard and run rank 0's steps, job/ranks.py's follow_job) in each other.

The ranks meet at rank 0's address: RayWorker.rendezvous opens rank 0's TCPStore on a port the system picks on
its node (held from then on: no other process can take it), and its object ref is handed to every rank's run
call unresolved (Ray resolves it before the call runs), so the driver never waits on a starting actor. The group
lives and dies whole: when any of its actors fails, the driver kills the others (the survivors would wait in a
collective) and removes the placement group; a new group takes its slot.
"""

from __future__ import annotations

from datetime import timedelta

from batchgen.config import JobSpec

# how long a rank waits for its group's others to meet (a rank that never starts: its placement group was
# placed, so only a broken node delays it this long); the collectives after that wait groups.PLAN_TIMEOUT
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)


def open_rendezvous(num_ranks: int):
    """(rank 0's TCPStore, listening on a port the system picked on this node; its "host:port")."""
    import ray
    import torch.distributed as dist

    host = ray.util.get_node_ip_address()
    store = dist.TCPStore(host, 0, num_ranks, True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)
    return store, f"{host}:{store.port}"


def join_group(spec: JobSpec, address: str, rank: int, store=None):
    """This actor's rank of its worker's group (a world of its own: T processes, group 0), and the spec with
    model.device set to this rank's device (an actor sees its one GPU as cuda:0). Rank 0 passes the store
    open_rendezvous gave it; the others connect to it at `address`."""
    import torch.distributed as dist

    from batchgen.distributed import groups
    from batchgen.runner.loader import resolve_device

    size = spec.engine.tensor_parallel_size
    device = resolve_device(spec.model.device)
    if store is None:
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), size, False, timeout=RENDEZVOUS_TIMEOUT)
    identity = groups.RankIdentity(rank, size, rank, size, 0, f"tcp://{address}", "ray")
    tp = groups.init_tensor_parallel(identity, device.type, store)
    if device.type == "cuda":
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={"device": str(tp.device)})})
    return tp, spec


class RayRank:
    """Rank r > 0 of a tensor-parallel Ray worker. Its signals are rank 0's to act on (the driver relays them
    there); it returns when rank 0 sends STOP."""

    def __init__(self, spec_data: dict, rank: int) -> None:
        self.spec_data, self.rank = spec_data, rank

    def run(self, address: str) -> int:
        from batchgen.distributed import groups
        from batchgen.job.ranks import follow_job

        tp, spec = join_group(JobSpec.model_validate(self.spec_data), address, self.rank)
        try:
            follow_job(spec, tp)
        finally:
            groups.destroy()
        return self.rank


class RankGroup:
    """A worker's placement group and the scheduling options of each of its bundles."""

    def __init__(self, size: int, bundle: dict) -> None:
        from ray.util.placement_group import placement_group

        self.pg = placement_group([dict(bundle) for _ in range(size)], strategy="STRICT_PACK")

    def options(self, bundle_index: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=bundle_index)}

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        except Exception:  # already removed, or Ray is shutting down
            pass

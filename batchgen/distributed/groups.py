"""Tensor-parallel process groups: who this process is (rank r of N in its group), a device group for the
forward's collectives (NCCL on CUDA, gloo on CPU) and a gloo group for host messages (step plans, start-up
agreement), so a plan never queues behind device work.

Identity (`identity_from_environment`): batchgen's own launcher sets BATCHGEN_TP_RANK / BATCHGEN_TP_SIZE /
BATCHGEN_TP_INIT (each group is its own world, on its own free port); under torchrun (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT) consecutive blocks of N global ranks form the groups: global rank g is rank
g % N of group g // N, which is data-parallel worker g // N of WORLD_SIZE // N.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from batchgen.distributed.plan import PlanChannel
from batchgen.models.shard import SHARD_ATTR, Shard, local_geometry, shard_model_

ENV_RANK, ENV_SIZE, ENV_INIT = "BATCHGEN_TP_RANK", "BATCHGEN_TP_SIZE", "BATCHGEN_TP_INIT"
# how long a follower waits for rank 0's next message (rank 0 may admit rows or commit shards for a long time
# between steps, or skip done rows for minutes before it builds the engine); a dead rank 0 is the launcher's
# (or torchrun's) to clean up, not this timeout's
PLAN_TIMEOUT = timedelta(hours=24)

_CURRENT: TensorParallelGroup | None = None  # the group init_tensor_parallel made in this process


@dataclass(frozen=True)
class RankIdentity:
    tp_rank: int  # within the group; 0: the leader
    tp_size: int
    world_rank: int
    world_size: int
    local_rank: int  # the GPU index on CUDA
    init_method: str  # torch.distributed's: tcp://HOST:PORT or env://
    source: str  # "batchgen run" | "torchrun" | "spawn"

    @property
    def group_index(self) -> int:
        return self.world_rank // self.tp_size

    @property
    def num_groups(self) -> int:
        return self.world_size // self.tp_size


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def identity_from_environment(size: int, env: Mapping[str, str] | None = None) -> RankIdentity | None:
    """This process's place in a tensor-parallel job of group size `size`, or None when nothing started it as
    a rank (then `batchgen run` starts the ranks itself)."""
    env = os.environ if env is None else env
    if ENV_RANK in env:
        rank, declared = _env_int(env, ENV_RANK), _env_int(env, ENV_SIZE)
        if declared != size:
            raise ValueError(f"{ENV_SIZE}={declared} but engine.tensor_parallel_size is {size}")
        return RankIdentity(rank, size, rank, size, rank, env[ENV_INIT], "batchgen run")
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
        if world % size:
            raise ValueError(f"torchrun's WORLD_SIZE {world} is not a multiple of engine.tensor_parallel_size "
                             f"{size}: start a multiple of {size} processes")
        local = _env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank % size
        return RankIdentity(rank % size, size, rank, world, local, "env://", "torchrun")
    return None


@dataclass
class TensorParallelGroup:
    rank: int  # 0 = the leader: scheduler, sampling owner, outputs
    size: int
    device: torch.device
    device_group: object  # ProcessGroup: NCCL on CUDA, gloo on CPU; the forward's all-reduce and all-gather
    cpu_group: object  # ProcessGroup, gloo: plans and start-up agreement
    leader: int  # the global rank of this group's rank 0
    plans: PlanChannel = field(init=False)

    def __post_init__(self) -> None:
        self.plans = PlanChannel(self.cpu_group, self.leader, self.is_leader)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def shard(self) -> Shard:
        return Shard(self.rank, self.size, self.all_reduce, self.all_gather)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group in place (same bytes on every rank). NCCL: queued on the current stream,
        capturable in a CUDA graph once the communicator exists (the decoder's start-up check runs one)."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, n] on every rank -> [B, size n], rank r's columns at [r n, (r + 1) n)."""
        b, n = x.shape
        out = x.new_empty((self.size * b, n))  # [size B, n]: rank blocks of rows
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.device_group)
        return out.view(self.size, b, n).permute(1, 0, 2).reshape(b, self.size * n)  # a copy, [B, size n]

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values (every rank calls it): e.g. KV blocks that fit on every GPU."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


def init_tensor_parallel(identity: RankIdentity, device_type: str, store=None) -> TensorParallelGroup:
    """Join the job's process groups (every process of the world calls this, in any order) and return this
    process's tensor-parallel group. device_type "cuda": this rank's GPU is cuda:LOCAL_RANK. `store`: the world's
    rendezvous store, opened by the caller (every rank then passes one: rank 0 its server, the others clients),
    instead of identity.init_method."""
    global _CURRENT
    if device_type == "cuda":
        device = torch.device("cuda", identity.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # ranks on one host share its cores: without this each would start one thread per core
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // identity.tp_size))
    if not dist.is_initialized():
        where = {"store": store} if store is not None else {"init_method": identity.init_method}
        dist.init_process_group("gloo", **where, rank=identity.world_rank, world_size=identity.world_size,
                                timeout=PLAN_TIMEOUT)
    mine = None
    for g in range(identity.num_groups):  # every process creates every group, in the same order
        ranks = list(range(g * identity.tp_size, (g + 1) * identity.tp_size))
        device_group = dist.new_group(ranks, backend="nccl" if device_type == "cuda" else "gloo")
        cpu_group = dist.new_group(ranks, backend="gloo", timeout=PLAN_TIMEOUT)
        if g == identity.group_index:
            mine = TensorParallelGroup(identity.tp_rank, identity.tp_size, device, device_group, cpu_group,
                                       leader=ranks[0])
    _CURRENT = mine
    return mine


def current() -> TensorParallelGroup | None:
    return _CURRENT


def destroy() -> None:
    """Leave every process group (the end of a rank's process; tests)."""
    global _CURRENT
    _CURRENT = None
    if dist.is_initialized():
        dist.destroy_process_group()


def for_engine(model: torch.nn.Module, config, tensor_parallel: TensorParallelGroup | None):
    """The group an Engine with `config` runs in (None for tensor_parallel_size 1), with the model sharded for
    this rank when it is not yet (copies on the GPU, views on the CPU: models/shard.py). ValueError naming
    engine.tensor_parallel_size when the model cannot be split, or this process is in no matching group."""
    from batchgen.models.registry import tensor_parallel_reason

    size = config.tensor_parallel_size
    tp = tensor_parallel if tensor_parallel is not None else (current() if size > 1 else None)
    if size == 1 and tp is None:
        return None
    if tp is None or tp.size != size:
        raise ValueError(f"engine.tensor_parallel_size is {size} but this process is "
                         f"{'in no tensor-parallel group' if tp is None else f'rank {tp.rank} of {tp.size}'}; "
                         f"start it with batchgen run, torchrun, or batchgen.distributed.spawn.run_group")
    reason = tensor_parallel_reason(model.config, size)
    if reason is not None:
        raise ValueError(f"engine.tensor_parallel_size {size}: {reason}")
    sharded = getattr(model, SHARD_ATTR, None)
    if sharded is None:
        shard_model_(model, tp.rank, size, copy=next(model.parameters()).device.type == "cuda")
    elif sharded != (tp.rank, size):
        raise ValueError(f"the model holds rank {sharded[0]} of {sharded[1]}'s shard; this is rank {tp.rank} of {size}")
    return tp


def local_kv_geometry(geometry, tp: TensorParallelGroup | None):
    """The KV cache geometry of this rank: its KV heads only."""
    return geometry if tp is None else local_geometry(geometry, tp.shard())


__all__ = ["RankIdentity", "TensorParallelGroup", "current", "destroy", "for_engine", "identity_from_environment",
           "init_tensor_parallel", "local_kv_geometry"]

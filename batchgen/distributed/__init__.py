"""Tensor parallelism: one process per rank, rank 0 the leader of its group.

Rank 0 runs the whole engine (scheduler, block manager, sampler, the job loop and every file the job writes);
each step it broadcasts the step's plan (the ScheduledBatch, pickled, on a gloo group: `plan.py`), then every
rank runs the same ModelRunner step over its shard of the weights (`models/shard.py`) and of the KV cache
(its KV heads only), joined by one all-reduce after attention's o_proj and one after the MLP's down projection,
and an all-gather of the vocabulary-split logits (`groups.py`: NCCL on CUDA, gloo on CPU). Every rank then
holds the same full logits and samples the same tokens (sampling noise is a function of seed, position and
vocab id only), so each rank's carry-over ids for the next step's placeholders are its own, with no per-step
token broadcast; the other ranks' StepOutputs are dropped (`follower.py`). `spawn.py` starts a group of local
processes (tests, the Python API); `batchgen run` starts its ranks itself (job/launcher.py) or runs under
torchrun (job/ranks.py).
"""

from batchgen.distributed.groups import TensorParallelGroup, for_engine, init_tensor_parallel
from batchgen.distributed.plan import PlanChannel

__all__ = ["PlanChannel", "TensorParallelGroup", "for_engine", "init_tensor_parallel"]

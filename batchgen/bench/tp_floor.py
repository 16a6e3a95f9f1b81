"""The floor of the seed workload under tensor parallelism (`batchgen bench --tensor-parallel N`), and the
collective latencies it is built from.

Per GPU, every step reads its shard of the weights (the layers' projections / N; the LM head / N, ceil(V / N)
rows, since the vocabulary is split; the embedding's rows are gathered, not read) and its KV heads' share of the
cached K/V (KV heads / N), at the copy bandwidth measured on rank 0's GPU; the prefill's FLOPs / N at the measured
matmul rate; and every step waits for 2 x num_layers all-reduces of the hidden states [B, E] (after o_proj and
after the MLP) and one all-gather of the vocabulary-split logits [B, ceil(V / N)] (distributed/groups.py), at the
latency measured in the run. Steps are counted as seed.floor_seconds counts them (`new` steps: the prefill step
and new - 1 decode steps). Left out, so the floor stays a lower bound: the norms (whole on every rank, < 0.01 %
of the bytes; decode_bytes leaves them out too) and the prefill step's larger all-reduces (counted at the decode
batch's size). With N = 1 and no collectives it is seed.floor_seconds.

The latencies are timed as the engine runs its collectives: captured in a CUDA graph (the decode forward is, with
its all-reduces and all-gather: runner/cuda_graphs.py), back to back, after warm-up, the median over many replays;
a graph replay launches no kernel from the host, so this is also the lowest latency an eager step could see.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from batchgen.bench.geometries import decode_bytes
from batchgen.bench.graph_timing import capture_graph
from batchgen.bench.seed import Ceilings


@dataclass(frozen=True)
class CollectiveLatency:
    all_reduce_s: float  # one all-reduce of the decode batch's hidden states [B, E]
    all_gather_s: float  # one all-gather of the decode batch's logits [B, ceil(V / N)] (and its reshape copy)


@dataclass(frozen=True)
class TensorParallelFloor:
    tensor_parallel_size: int
    weight_bytes_per_gpu: int  # one step's weight reads on one GPU
    kv_bytes_per_gpu: int  # the whole run's K/V reads on one GPU
    prefill_flops_per_gpu: float
    num_steps: int
    all_reduces_per_step: int
    all_gathers_per_step: int
    weights_s: float
    kv_s: float
    prefill_s: float
    collectives_s: float

    @property
    def seconds(self) -> float:
        return self.weights_s + self.kv_s + self.prefill_s + self.collectives_s

    def parts(self) -> dict:
        """Every field and the total, for the report."""
        return {**asdict(self), "floor_s": self.seconds}


def tensor_parallel_floor(config, requests: int, prompt: int, new: int, size: int, ceilings: Ceilings,
                          latency: CollectiveLatency, dtype_bytes: int = 2) -> TensorParallelFloor:
    """The seed workload's floor on each of `size` GPUs (dense models: tensor parallelism of MoE models is not
    built). Every split is exact: tensor_parallel_reason guarantees heads, KV heads and the MLP divide by size."""
    b = decode_bytes(config, dtype_bytes)
    if b.num_experts:
        raise ValueError("the tensor-parallel floor counts dense models only")
    cfg = config.get_text_config()
    head_bytes = cfg.vocab_size * cfg.hidden_size * dtype_bytes  # decode_bytes counts the LM head once (tied too)
    head_rows_per_gpu = -(-cfg.vocab_size // size)  # the last rank's are zero-padded: read all the same
    weight_bytes = (b.dense_weight_bytes - head_bytes) // size + head_rows_per_gpu * cfg.hidden_size * dtype_bytes
    kv_bytes = requests * b.kv_bytes_decoding(prompt, new) // size
    # prompt tokens skip the LM head (as bench/seed.floor_seconds counts them)
    prefill_flops = 2 * (b.active_params_per_token(0) - b.head_params) * requests * prompt / size
    all_reduces, all_gathers = (2 * cfg.num_hidden_layers, 1) if size > 1 else (0, 0)
    collectives_s = new * (all_reduces * latency.all_reduce_s + all_gathers * latency.all_gather_s)
    return TensorParallelFloor(
        tensor_parallel_size=size, weight_bytes_per_gpu=weight_bytes, kv_bytes_per_gpu=kv_bytes,
        prefill_flops_per_gpu=prefill_flops, num_steps=new, all_reduces_per_step=all_reduces,
        all_gathers_per_step=all_gathers, weights_s=new * weight_bytes / ceilings.copy_bytes_s,
        kv_s=kv_bytes / ceilings.copy_bytes_s, prefill_s=prefill_flops / ceilings.matmul_flop_s,
        collectives_s=collectives_s)


def measure_collective_latency(tp, num_rows: int, config, dtype: torch.dtype = torch.bfloat16,
                               per_graph: int = 64, num_replays: int = 50) -> CollectiveLatency:
    """The latency of one all-reduce of [num_rows, E] and one all-gather of [num_rows, ceil(V / N)] between the
    ranks of `tp` (CUDA; every rank calls it, at the same point). Each graph holds `per_graph` of one collective;
    its replays are queued back to back with an event between each two (host launch skew between the ranks then
    delays the first replay only), and the median replay over per_graph is the latency."""
    cfg = config.get_text_config()
    # zeros: an in-place sum of zeros stays zeros, however often it is replayed
    hidden = torch.zeros(num_rows, cfg.hidden_size, dtype=dtype, device=tp.device)
    logits = torch.zeros(num_rows, -(-cfg.vocab_size // tp.size), dtype=dtype, device=tp.device)
    return CollectiveLatency(all_reduce_s=_graphed_seconds(lambda: tp.all_reduce(hidden), per_graph, num_replays),
                             all_gather_s=_graphed_seconds(lambda: tp.all_gather(logits), per_graph, num_replays))


def _graphed_seconds(collective, per_graph: int, num_replays: int) -> float:
    # warm-up outside capture first: NCCL's communicator and buffers exist before a graph records them
    graph = capture_graph(collective, per_graph, warmup=3)
    for _ in range(3):
        graph.replay()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(num_replays + 1)]
    events[0].record()
    for event in events[1:]:
        graph.replay()
        event.record()
    torch.cuda.synchronize()
    replay_ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    return statistics.median(replay_ms) / 1e3 / per_graph

"""`batchgen bench --tensor-parallel N`: the seed workload (bench/seed.py) on N GPUs of one host, one process per
rank (distributed/spawn.py run_group), rank r on GPU r, against its floor (bench/tp_floor.py).

Each rank builds its own shard of the random model on its GPU (bench/tp_shard.py: the whole model never exists),
then every rank times the collectives together (tp_floor.measure_collective_latency). Per variant, every rank
builds an Engine of the same config over its shard; rank 0 runs seed.run_ours (the single-GPU bench's timing:
warm-up, timed generate, kernels per decode step), the others serve its steps (distributed/follower.py) until
its engine closes. Rank 0 measures the copy bandwidth and matmul rate on its GPU before building its shard, and
returns the report; the parent prints it.
"""

from __future__ import annotations

import json
import time

import torch

RUN_GROUP_TIMEOUT_S = 3600.0  # the whole group: spawn, shards, engines, every variant (70B: a few minutes)


def bench_reason(size: int, workload: str, geometry: str, weights: str, variants: str, transformers: str) -> str | None:
    """Why `batchgen bench --tensor-parallel size` cannot run with these options, from configs alone (before any GPU
    is touched), or None. Phrased as one sentence naming --tensor-parallel."""
    from batchgen.bench.geometries import model_config
    from batchgen.bench.seed import VARIANTS, seed_engine_config
    from batchgen.quant.scheme import EXPERT_KEYS
    from batchgen.models.registry import tensor_parallel_reason

    option = f"--tensor-parallel {size}"
    if size < 2:
        return f"{option}: give 2 or more GPUs (leave it out to run on one)"
    if workload != "seed":
        return f"{option} runs the seed workload only, not --workload {workload}"
    if weights != "bf16":
        return f"{option} runs bf16 weights only, not --weights {weights} (FP8 weight scales are not sharded)"
    if transformers:
        return f"{option}: transformers' runs need the whole model on one GPU; leave out --transformers"
    config = model_config(geometry)
    reason = tensor_parallel_reason(config, size)
    if reason is None and any(getattr(config, k, None) for k in EXPERT_KEYS):  # the engine splits MoE models
        reason = ("the tensor-parallel bench's floor counts dense weights; mixture-of-experts geometries (their "
                  "routed-bytes floor) run on one GPU")
    if reason is not None:
        return f"{option} with --model-geometry {geometry}: {reason}"
    for variant in variants.split(","):
        if variant not in VARIANTS:
            return f"{option}: unknown variant {variant!r} (one of {', '.join(VARIANTS)})"
        try:
            seed_engine_config(1, variant, size)
        except ValueError as e:  # pydantic's ValidationError is a ValueError: transformers' modules, compile
            return f"{option} with variant {variant!r}: {e}"
    return None


def follow_engine(model: torch.nn.Module, config, tp):
    """A rank > 0's part of one engine's life: build it over `model` (this rank's shard) as rank 0 builds its own,
    serve rank 0's steps until rank 0 closes its engine, close this one. Returns follow's FollowResult."""
    from batchgen.distributed.follower import follow
    from batchgen.engine.engine import Engine

    assert not tp.is_leader
    engine = Engine(model, None, config, tensor_parallel=tp)
    try:
        return follow(engine.runner, tp.plans)
    finally:
        engine.close()


def _rank(tp, geometry: str, requests: int, prompt_len: int, new_tokens: int, max_num_seqs: int,
          variants: str) -> dict | None:
    """One rank's bench (run_group's fn): rank 0's report, None on the other ranks."""
    from batchgen.bench.geometries import model_config
    from batchgen.bench.seed import measure_ceilings, run_ours, score_variant, seed_engine_config, seed_prompts
    from batchgen.bench.tp_floor import measure_collective_latency, tensor_parallel_floor
    from batchgen.bench.tp_shard import build_random_shard

    config = model_config(geometry)
    ceilings = measure_ceilings() if tp.is_leader else None  # on this rank's GPU (init_tensor_parallel set it)
    torch.cuda.empty_cache()  # its buffers, or rank 0's KV cache (and, agreed, every rank's) would come out smaller
    t0 = time.perf_counter()
    model = build_random_shard(config, tp.rank, tp.size, tp.device)
    torch.cuda.synchronize(tp.device)
    build_s = time.perf_counter() - t0
    # the decode batch's rows (at the seed workload's 32 also its CUDA graph's bucket, so no padding rows)
    latency = measure_collective_latency(tp, min(requests, max_num_seqs), config)
    if not tp.is_leader:
        for variant in variants.split(","):
            follow_engine(model, seed_engine_config(max_num_seqs, variant, tp.size), tp)
        return None
    floor = tensor_parallel_floor(config, requests, prompt_len, new_tokens, tp.size, ceilings, latency)
    report = {"gpu": torch.cuda.get_device_name(tp.device), "torch": torch.__version__, "geometry": geometry,
              "weights": "bf16", "tensor_parallel_size": tp.size,
              "copy_TBps": ceilings.copy_bytes_s / 1e12, "matmul_TFLOPs": ceilings.matmul_flop_s / 1e12,
              "all_reduce_us": latency.all_reduce_s * 1e6, "all_gather_us": latency.all_gather_s * 1e6,
              "build_shard_s": build_s, "requests": requests, "prompt_len": prompt_len, "new_tokens": new_tokens,
              "floor_s": floor.seconds, "floor_tok_s": requests * new_tokens / floor.seconds,
              "floor_parts": floor.parts()}
    print("floor", json.dumps(report), flush=True)
    prompts = seed_prompts(requests, prompt_len)
    reference_tokens = None
    for variant in variants.split(","):
        key = f"ours_tp{tp.size}_{variant}"
        r = report[key] = run_ours(model, prompts, new_tokens, max_num_seqs, variant, tensor_parallel=tp)
        reference_tokens = score_variant(r, floor.seconds, reference_tokens)
        print(key, json.dumps(r), flush=True)
    return report


def main(size: int, new_tokens: int = 1024, requests: int = 32, prompt_len: int = 256, json_path: str | None = None,
         max_num_seqs: int = 32, variants: str = "graphs_async", geometry: str = "llama-70b") -> dict:
    from batchgen.bench.seed import summary_table
    from batchgen.distributed.spawn import run_group

    report = run_group(_rank, size, geometry, requests, prompt_len, new_tokens, max_num_seqs, variants,
                       device_type="cuda", timeout_s=RUN_GROUP_TIMEOUT_S)[0]
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    parts = report["floor_parts"]
    print(f"floor parts (per GPU, {size} GPUs): weights {parts['weights_s']:.2f} s "
          f"({parts['weight_bytes_per_gpu'] / 1e9:.1f} GB a step), K/V {parts['kv_s']:.2f} s, prefill "
          f"{parts['prefill_s']:.2f} s, collectives {parts['collectives_s']:.2f} s ({parts['all_reduces_per_step']} "
          f"all-reduces at {report['all_reduce_us']:.1f} us + {parts['all_gathers_per_step']} all-gather at "
          f"{report['all_gather_us']:.1f} us a step); shards built in {report['build_shard_s']:.1f} s")
    print(summary_table(report))
    return report

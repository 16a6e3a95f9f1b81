"""`batchgen bench`: the seed workload on one GPU, ours against transformers and the bandwidth floor.

Workload (design.md section 6): Llama-3.1-8B geometry with random bf16 weights (seed 0), `--requests`
random 256-token prompts (ids 3..16000, seed 0), greedy, EOS off, `--new-tokens` each.
Floor: bytes every decode step must read (weights less the embedding, plus all cached K/V) over the copy
bandwidth measured in the same run, plus prefill FLOPs at the measured bf16 matmul rate.
On several GPUs (`--tensor-parallel N`): bench/tp_seed.py runs this module's run_ours on rank 0.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass

import torch

from batchgen.bench.geometries import LLAMA_8B, decode_bytes, model_config  # noqa: F401 (LLAMA_8B: bench scripts)
from batchgen.kernels.fp8.blockwise import Fp8PathUnavailable


@dataclass
class Ceilings:
    copy_bytes_s: float  # device-to-device copy, bytes read + written per second
    matmul_flop_s: float  # bf16 8192^3 matmul
    fp8_matmul_flop_s: float | None = None  # FP8 (e4m3) 8192^3 torch._scaled_mm, row-wise scales; None: not measured
    # the bf16 8192^3 matmul held for about a second: a GPU at its power limit lowers its clock under long GEMM
    # runs (one H100 on 2026-12-05: 690-694 against 789 TFLOP/s, bench/gemm_shapes.py); None: not measured
    matmul_sustained_flop_s: float | None = None

    def gemm_s(self, flops: float, fp8: bool = False) -> float:
        """Seconds for `flops` of GEMMs at the measured rate: FP8's where `fp8` (a job whose projections are FP8)
        and it was measured, else bf16's."""
        rate = self.fp8_matmul_flop_s if fp8 and self.fp8_matmul_flop_s else self.matmul_flop_s
        return flops / rate


def _timed_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Mean ms of `fn()` on the current CUDA stream, timed with events after `warmup` calls."""
    for _ in range(warmup):
        fn()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def measure_ceilings(fp8: bool = False) -> Ceilings:
    """The copy bandwidth and bf16 matmul rate of GPU 0; with `fp8`, the FP8 matmul rate too (for FP8 checkpoints,
    whose projection GEMMs run in FP8: their FLOPs are timed at that rate)."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() / (_timed_ms(lambda: y.copy_(x), iters=20) / 1e3)
    del x, y
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    flops = 2 * n**3 / (_timed_ms(lambda: a @ b) / 1e3)
    # ~0.8 s of calls first (the clock settles at the power limit), then ~0.8 s timed
    sustained = 2 * n**3 / (_timed_ms(lambda: a @ b, warmup=max(3, int(0.8 / (2 * n**3 / flops))),
                                      iters=max(10, int(0.8 / (2 * n**3 / flops)))) / 1e3)
    fp8_flops = None
    if fp8:
        from batchgen.kernels.fp8.quant import FP8_DTYPE

        a8, b8 = a.to(FP8_DTYPE), b.to(FP8_DTYPE)  # b8.t(): the column-major operand _scaled_mm wants
        sa = torch.ones(n, 1, device="cuda", dtype=torch.float32)
        sb = torch.ones(1, n, device="cuda", dtype=torch.float32)
        try:
            fp8_flops = 2 * n**3 / (_timed_ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                                                                       out_dtype=torch.bfloat16)) / 1e3)
        except RuntimeError as e:  # no FP8 matmul on this GPU (before sm89): FP8 FLOPs timed at bf16's rate
            print(f"FP8 matmul rate not measured ({str(e).splitlines()[0]}): FP8 GEMM FLOPs at the bf16 rate")
    return Ceilings(bw, flops, fp8_flops, sustained)


def floor_seconds(config, requests: int, prompt: int, new: int, c: Ceilings,
                  distinct_experts_per_step: float | None = None) -> float:
    """Every decode step's weight bytes (MoE: the experts it routes to, summed over layers; None: all of
    them) and every sequence's cached K/V bytes (sliding layers: their window) at the copy bandwidth, plus
    the prefill's FLOPs at the matmul rate (FP8 projections: at the FP8 rate, where measured)."""
    b = decode_bytes(config)
    top_k = getattr(config.get_text_config(), "num_experts_per_tok", 0) or 0
    weights = new * b.weight_bytes(None if distinct_experts_per_step is None else round(distinct_experts_per_step))
    kv = requests * b.kv_bytes_decoding(prompt, new)
    return (weights + kv) / c.copy_bytes_s + b.gemm_s(requests * prompt, top_k, c, head=False)


def build_model(num_layers: int | None = None, geometry: str = "llama-8b", weights: str = "bf16"):
    """Random bf16 weights (seed 0) at a real model's geometry (bench/geometries.py), on the GPU; `weights` fp8 /
    fp8-channel: the layers' projections FP8 (bench/fp8_weights.py; its floor counts them at one byte)."""
    from transformers import AutoModelForCausalLM

    config = model_config(geometry, **({"num_hidden_layers": num_layers} if num_layers else {}))
    if weights != "bf16":
        from batchgen.bench.fp8_weights import build_fp8_model

        return build_fp8_model(config, weights)
    torch.manual_seed(0)
    with torch.device("cuda"):
        try:  # sdpa for transformers' own runs where the architecture has it (Gemma2 does not: soft-capping)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        except ValueError:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager")
    return model.eval()


def seed_prompts(requests: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 16000, (prompt_len,), generator=g).tolist() for _ in range(requests)]


VARIANTS = {  # name -> EngineConfig overrides
    "eager": dict(cuda_graphs=False, async_pipeline=False),
    "graphs": dict(cuda_graphs=True, async_pipeline=False),  # fused decoder (Llama) in the graphs
    "graphs_transformers": dict(cuda_graphs=True, fused_decoder=False, async_pipeline=False),  # transformers' modules
    "compiled": dict(cuda_graphs=True, compile=True, async_pipeline=False),  # transformers' modules, torch.compiled
    "graphs_async": dict(cuda_graphs=True, async_pipeline=True),  # cuBLASLt GEMMs in the graphs (the default)
    "graphs_async_cublas": dict(cuda_graphs=True, async_pipeline=True, graph_blas_library="cublas"),
    "compiled_async": dict(cuda_graphs=True, compile=True, async_pipeline=True),
    # FP8 checkpoints (--weights fp8): one block-scaled GEMM path at every batch size (engine.fp8_gemm)
    "graphs_async_fp8_blockwise": dict(cuda_graphs=True, async_pipeline=True, fp8_gemm="blockwise"),
    "graphs_async_fp8_triton": dict(cuda_graphs=True, async_pipeline=True, fp8_gemm="triton"),
    "graphs_async_fp8_splitk": dict(cuda_graphs=True, async_pipeline=True, fp8_gemm="splitk"),
}


def timed_generate(engine, prompts, params) -> tuple[list, float, float]:
    """`engine.generate` timed: (results, wall seconds, GPU busy fraction: the device time of its steps, from
    each step's first kernel to its last (`Engine.stats()["gpu_busy_s"]`), over the wall time)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    busy0 = engine.runner.timing.gpu_busy_s
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return results, wall, (engine.runner.timing.gpu_busy_s - busy0) / wall


def release(engine) -> None:
    """Give an engine's GPU memory back (its KV cache and graph pool) for the next contender."""
    engine.close()


def seed_engine_config(max_num_seqs: int, variant: str, tensor_parallel_size: int = 1):
    """The EngineConfig of `variant` in the seed workload (every rank of a tensor-parallel group builds the same)."""
    from batchgen.engine.config import EngineConfig

    return EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                        tensor_parallel_size=tensor_parallel_size, **VARIANTS[variant])


def run_ours(model, prompts: list[list[int]], new_tokens: int, max_num_seqs: int, variant: str,
             tensor_parallel=None) -> dict:
    """`variant` over the prompts, timed. tensor_parallel: this process's TensorParallelGroup, rank 0 (`model` its
    shard); the other ranks must serve its steps meanwhile (bench/tp_seed.py follow_engine)."""
    from batchgen.engine.engine import Engine
    from batchgen.sampling_params import SamplingParams

    t_setup = time.perf_counter()
    size = tensor_parallel.size if tensor_parallel is not None else 1
    engine = Engine(model, None, seed_engine_config(max_num_seqs, variant, size), tensor_parallel=tensor_parallel)
    setup_s = time.perf_counter() - t_setup
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))  # JIT warm-up
    steps0, sched0, prep0 = engine.num_steps, engine.schedule_s, engine.runner.prepare_s
    routes = None
    if hasattr(engine.runner.decode_forward, "count_routes"):  # MoE: the floor needs each step's distinct experts
        from batchgen.bench.moe_floor import RouteRecorder

        routes = RouteRecorder(engine)
    with routes.watch() if routes is not None else contextlib.nullcontext():
        results, wall, busy = timed_generate(engine, prompts, params)
    steps = engine.num_steps - steps0
    tokens = sum(len(r.samples[0].token_ids) for r in results)
    kernels = count_kernels_per_decode_step(engine, prompts[0])
    tokens_out = [r.samples[0].token_ids for r in results]
    cpu_ms_per_step = 1e3 * ((engine.schedule_s - sched0) + (engine.runner.prepare_s - prep0)) / steps
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    release(engine)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "steps": steps, "setup_s": setup_s,
            "decode_path": engine.decode_path,
            "_token_ids": tokens_out,
            "cpu_ms_per_step": cpu_ms_per_step, "gpu_busy": busy,
            "kernels_per_decode_step": kernels, "peak_gpu_gib": peak_gib,
            "first_tokens": [t[:8] for t in tokens_out[:2]],
            **({"_distinct_experts": routes.distinct_per_step()} if routes is not None else {})}


def count_kernels_per_decode_step(engine, prompt: list[int]) -> int:
    from torch.profiler import ProfilerActivity, profile

    from batchgen.sampling_params import SamplingParams

    engine.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill
    engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished:
        engine.step()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def run_transformers(model, prompts: list[list[int]], new_tokens: int, mode: str) -> dict:
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    blocks = len(prompts) * ((len(prompts[0]) + new_tokens) // 256 + 2)
    cb = ContinuousBatchingConfig(num_blocks=blocks, block_size=256, max_batch_tokens=2048,
                                  use_cuda_graph=(mode == "async"), use_async_batching=(mode == "async"))
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "first_tokens": [out[k].generated_tokens[:8] for k in sorted(out)[:2]]}


def main(new_tokens: int = 1024, requests: int = 32, prompt_len: int = 256, transformers_modes: str = "",
         json_path: str | None = None, max_num_seqs: int = 256, variants: str = "graphs",
         geometry: str = "llama-8b", weights: str = "bf16") -> dict:
    ceilings = measure_ceilings(fp8=weights != "bf16")
    model = build_model(geometry=geometry, weights=weights)
    prompts = seed_prompts(requests, prompt_len)
    moe = bool(decode_bytes(model.config).num_experts)  # its floor: the first variant's measured routing
    floor = None if moe else floor_seconds(model.config, requests, prompt_len, new_tokens, ceilings)
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "geometry": geometry, "weights": weights,
              "copy_TBps": ceilings.copy_bytes_s / 1e12, "matmul_TFLOPs": ceilings.matmul_flop_s / 1e12,
              "fp8_matmul_TFLOPs": ceilings.fp8_matmul_flop_s and ceilings.fp8_matmul_flop_s / 1e12,
              "requests": requests, "prompt_len": prompt_len, "new_tokens": new_tokens}
    reference_tokens = None
    for variant in variants.split(","):
        try:
            r = run_ours(model, prompts, new_tokens, max_num_seqs, variant)
        except Fp8PathUnavailable as e:  # a path this device lacks (engine.fp8_gemm: blockwise without cuBLASLt's
            # block-wise scaling): recorded, and the other variants still run
            report[f"ours_sync_{variant}"] = {"refused": str(e)}
            print(f"ours_sync_{variant} refused: {e}", flush=True)
            continue
        report[f"ours_sync_{variant}"] = r
        distinct = r.pop("_distinct_experts", None)
        if distinct:
            from batchgen.bench.moe_floor import routed_floor_seconds, routed_step_bytes, sparse_layers
            from batchgen.quant.scheme import is_fp8

            r["distinct_experts_per_sparse_layer"] = sum(distinct) / len(distinct) / sum(sparse_layers(model.config))
            if floor is None:
                proj = 1 if is_fp8(model.config) else None  # FP8 projections and experts: one byte a weight
                # prefill: every prompt token through the dense weights and its top-k experts (FP8 at the FP8 rate)
                prefill_s = decode_bytes(model.config).gemm_s(requests * prompt_len,
                                                              model.config.num_experts_per_tok, ceilings, head=False)
                floor = routed_floor_seconds(model.config, routed_step_bytes(distinct, model.config, 2, proj), requests,
                                             prompt_len, new_tokens, ceilings, prefill_s)
        if floor is None:
            raise ValueError(f"geometry {geometry}: the first variant must run the fused MoE forward (its routing "
                             f"gives the floor), not {variant!r}")
        report["floor_s"], report["floor_tok_s"] = floor, requests * new_tokens / floor
        reference_tokens = score_variant(r, floor, reference_tokens)
        print(f"ours_sync_{variant}", json.dumps(r), flush=True)
    ran = [report[f"ours_sync_{v}"] for v in variants.split(",") if "refused" not in report[f"ours_sync_{v}"]]
    if not ran:
        raise ValueError(f"every variant was refused: {variants}")
    ours = ran[0]
    for mode in filter(None, transformers_modes.split(",")):
        torch.cuda.empty_cache()
        report[f"transformers_{mode}"] = r = run_transformers(model, prompts, new_tokens, mode)
        r["ours_speedup"] = r["wall_s"] / ours["wall_s"]
        print(mode, json.dumps(r), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    print(summary_table(report))
    return report


def score_variant(r: dict, floor_s: float, reference_tokens: list | None) -> list:
    """Set run_ours' result `r`'s x_floor and same_tokens_as_first_variant (its token ids, popped from r, against
    the first variant's); returns the first variant's token ids (r's own when `reference_tokens` is None)."""
    r["x_floor"] = r["wall_s"] / floor_s
    token_ids = r.pop("_token_ids")
    if reference_tokens is None:
        reference_tokens = token_ids
    r["same_tokens_as_first_variant"] = sum(a == b for a, b in zip(token_ids, reference_tokens))
    return reference_tokens


def summary_table(report: dict) -> str:
    """The floor and every run of the report (keys ours* and transformers*): wall s, tok/s, x floor, and the
    kernels of one decode step where the run counted them."""
    floor = report["floor_s"]
    rows = [("mode", "wall s", "tok/s", "x floor", "kernels/step")]
    rows.append(("floor", f"{floor:.2f}", f"{report['floor_tok_s']:.0f}", "1.00", ""))
    for key in [k for k in report if k.startswith(("ours", "transformers"))]:
        r = report[key]
        if "refused" in r:
            rows.append((key, "refused", "", "", ""))
            continue
        rows.append((key, f"{r['wall_s']:.2f}", f"{r['tok_s']:.0f}", f"{r['wall_s'] / floor:.2f}",
                     str(r.get("kernels_per_decode_step", ""))))
    return "\n".join(f"{a:<24}{b:>10}{c:>10}{d:>9}{e:>14}" for a, b, c, d, e in rows)

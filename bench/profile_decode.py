"""Where one decode step's time goes on the GPU (seed workload geometry: Llama-3.1-8B, random bf16 weights).

Prints, for a graphed decode step of `--batch` sequences at `--context` tokens: the step's device time
(graph replay, event-timed) and its wall time through `Engine.step`, the kernel time grouped by kernel name
(torch profiler over graph replays), and isolated micro-benchmarks of what dominates: each decode GEMM shape
(achieved weight-read bandwidth, cuBLAS and cuBLASLt) and the Triton decode attention over a grid of
(splits, block_n, num_warps, num_stages) against the engine's default launch.

    python3 bench/profile_decode.py --batch 32 --context 768 [--compile] [--json out.json]
    python3 bench/profile_decode.py --model-geometry gemma2-9b --engine-only   # another family's step only
    python3 bench/profile_decode.py --deterministic --batch 256 --context 768  # engine.deterministic's step

--deterministic profiles the step of engine.deterministic (batch-invariant GEMMs and attention) and implies
--engine-only (the isolated benches time the default kernels; bench/invariant_gemm.py times the invariant GEMMs);
the report adds each weight's GEMM path (the fixed-row cuBLAS GEMM, or the Triton one where the self-check failed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchgen.bench.graph_timing import capture_graph  # noqa: E402
from batchgen.bench.seed import build_model, measure_ceilings, seed_prompts  # noqa: E402
from batchgen.engine.config import EngineConfig  # noqa: E402
from batchgen.engine.engine import Engine  # noqa: E402
from batchgen.sampling_params import SamplingParams  # noqa: E402


def event_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def graph_ms(fn, reps: int = 10) -> float:
    """Per-call device time of `fn` replayed from a CUDA graph (no host launch overhead)."""
    return event_ms(capture_graph(fn, reps).replay, 5) / reps


def kernel_table(replay, reps: int = 3) -> tuple[list[tuple[str, int, float]], float]:
    """(name, launches per step, µs per step) sorted by time, and total kernel µs per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    count, total = defaultdict(int), defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count[e.name] += 1
            total[e.name] += e.device_time
    rows = sorted(((n, count[n] // reps, total[n] / reps) for n in count), key=lambda r: -r[2])
    return rows, sum(r[2] for r in rows)


def gemm_bench(m: int, matmul_flop_s: float) -> list[dict]:
    """Each Llama-8B projection at `m` rows (and the LM head at the benches' 49,152-token vocabulary beside
    Llama's 128,256) through both of torch's BLAS back-ends: its time, the weight-read
    bandwidth it reached (what bounds small m) and its FLOPs over the matmul rate measured in this run
    (`x_matmul`: what bounds large m; 1.0 = the rate)."""
    shapes = {"q/o 4096x4096": (4096, 4096), "k|v 1024x4096": (1024, 4096), "qkv 6144x4096": (6144, 4096),
              "gate|up 14336x4096": (14336, 4096), "gate_up 28672x4096": (28672, 4096),
              "down 4096x14336": (4096, 14336), "lm_head 49152x4096": (49152, 4096),
              "lm_head 128256x4096": (128256, 4096)}
    out = []
    previous = torch.backends.cuda.preferred_blas_library()
    for library in ("cublas", "cublaslt"):  # torch's two BLAS back-ends pick different kernels at small M
        torch.backends.cuda.preferred_blas_library(library)
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = graph_ms(lambda: torch.nn.functional.linear(x, w))
            out.append({"blas": library, "gemm": name, "us": round(ms * 1e3, 1),
                        "weight_TBps": round(w.numel() * 2 / ms / 1e9, 2),
                        "x_matmul": round(ms / 1e3 / (2 * m * n * k / matmul_flop_s), 3)})
    torch.backends.cuda.preferred_blas_library(previous)
    return out


def attention_bench(batch: int, context: int, sweep: bool = True) -> list[dict]:
    from triton.runtime.errors import OutOfResources

    from batchgen.kernels.attention.paged_decode import DecodeLaunch, paged_decode_attention

    bs, hkv, heads, d = 16, 8, 32, 128
    blocks_per_seq = -(-context // bs)
    num_blocks = batch * blocks_per_seq
    k = torch.randn(num_blocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
    kv_bytes = 2 * batch * context * hkv * d * 2
    out = []
    for splits in (1, 2, 4) if sweep else ():  # 81 configs, each compiled once: ~1-2 minutes
        for block_n in (32, 64, 128):
            for num_warps in (2, 4, 8):
                for num_stages in (2, 3, 4):
                    launch = DecodeLaunch(splits, block_n, num_warps, num_stages)  # sequences first

                    def run():
                        return paged_decode_attention(q, k, v, table, lens, d ** -0.5, launch=launch)
                    try:
                        ms = graph_ms(run)
                    except OutOfResources:  # a tile too large for shared memory: not a candidate
                        continue
                    out.append({"splits": splits, "block_n": block_n, "num_warps": num_warps,
                                "num_stages": num_stages, "heads_first": False, "us": round(ms * 1e3, 1),
                                "kv_TBps": round(kv_bytes / ms / 1e9, 2)})
    default = graph_ms(lambda: paged_decode_attention(q, k, v, table, lens, d ** -0.5))
    out.append({"engine_default": True, "us": round(default * 1e3, 1), "kv_TBps": round(kv_bytes / default / 1e9, 2)})
    out += rope_fusion_bench(k, v, table, lens, heads)
    return out


def rope_fusion_bench(k, v, table, lens, heads: int) -> list[dict]:
    """The fused decoder's attention step two ways: rope_kv then paged_decode_attention (2-3 kernels), and
    paged_decode_rope_attention (1-2 kernels) at 1 and 2 splits."""
    from batchgen.kernels.attention.paged_decode import paged_decode_attention, paged_decode_rope_attention
    from batchgen.kernels.attention.rope_kv import rope_kv

    batch, (hkv, d) = lens.shape[0], k.shape[2:]
    qkv = torch.randn(batch, (heads + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.rand(batch, d, device="cuda", dtype=torch.bfloat16), torch.rand(batch, d, device="cuda",
                                                                                      dtype=torch.bfloat16)
    slots = (table[:, -1].long() * k.shape[1])  # any slot of each sequence's last block

    def unfused():
        q = rope_kv(qkv, cos, sin, slots, k, v, heads, hkv)
        return paged_decode_attention(q, k, v, table, lens, d ** -0.5)

    rows = [{"rope_kv_then_attention": True, "us": round(graph_ms(unfused) * 1e3, 1)}]
    for splits in (None, 1, 2):
        ms = graph_ms(lambda: paged_decode_rope_attention(qkv, cos, sin, slots, k, v, table, lens, d ** -0.5, heads,
                                                          num_splits=splits))
        rows.append({"rope_fused": True, "splits": splits or "default", "us": round(ms * 1e3, 1)})
    return rows


def attention_in_engine(engine, heads: int) -> list[dict]:
    """Why decode attention runs slower in the step than alone: the fused attention (rope, K/V write, attention;
    the engine's default launch) timed on the engine's own cache and block tables (its running sequences), on
    layer 0 alone, cycling over every layer, on a compact copy of the same blocks (each sequence's blocks in a
    row of a fresh cache sized to them), and right after a gate_up GEMM of the batch's rows."""
    from batchgen.kernels.attention.paged_decode import paged_decode_rope_attention

    cache, bs = engine.kv_cache, engine.kv_cache.block_size
    seqs = list(engine.scheduler.running)
    width = max(len(r.block_table) for r in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, r in enumerate(seqs):
        table[i, :len(r.block_table)] = torch.tensor(r.block_table, dtype=torch.int32)
    lens = torch.tensor([min(r.num_computed_tokens + 1, len(r.block_table) * bs) for r in seqs], dtype=torch.int32)
    table, lens = table.cuda(), lens.cuda()
    num_layers, hkv, d = cache.k_cache.shape[0], cache.k_cache.shape[3], cache.k_cache.shape[4]
    qkv = torch.randn(len(seqs), (heads + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    cos = torch.rand(len(seqs), d, device="cuda", dtype=torch.bfloat16)
    sin = torch.rand(len(seqs), d, device="cuda", dtype=torch.bfloat16)

    slots = {}  # table's data pointer -> [B] each sequence's next slot (computed outside the timed graphs)

    def call(k, v, tab):
        if tab.data_ptr() not in slots:
            slots[tab.data_ptr()] = tab[torch.arange(len(seqs), device="cuda"), (lens - 1) // bs].long() * bs + \
                (lens - 1) % bs
        return paged_decode_rope_attention(qkv, cos, sin, slots[tab.data_ptr()], k, v, tab, lens, d ** -0.5, heads)

    call(*cache.layer(0), table)  # its slots, outside the timed graphs
    rows = [{"in_engine": "layer 0", "us": round(graph_ms(lambda: call(*cache.layer(0), table)) * 1e3, 1)}]
    every = graph_ms(lambda: [call(*cache.layer(i), table) for i in range(num_layers)], reps=2) / num_layers
    rows.append({"in_engine": "every layer in turn", "us": round(every * 1e3, 1)})
    used = [b for r in seqs for b in r.block_table]
    k0, v0 = cache.layer(0)
    index = torch.tensor(used, device="cuda")
    compact_k, compact_v = k0[index].contiguous(), v0[index].contiguous()
    compact = torch.zeros_like(table)
    at = 0
    for i, r in enumerate(seqs):
        compact[i, :len(r.block_table)] = torch.arange(at, at + len(r.block_table), dtype=torch.int32)
        at += len(r.block_table)
    call(compact_k, compact_v, compact)
    rows.append({"in_engine": "compact copy", "us": round(graph_ms(lambda: call(compact_k, compact_v, compact)) * 1e3,
                                                        1)})
    x = torch.randn(len(seqs), 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16)
    gemm_ms = graph_ms(lambda: x @ w.T)
    pair_ms = graph_ms(lambda: (x @ w.T, call(*cache.layer(0), table)))
    rows.append({"in_engine": "after a gate_up GEMM (pair minus GEMM)", "us": round((pair_ms - gemm_ms) * 1e3, 1),
                 "gemm_us": round(gemm_ms * 1e3, 1)})
    return rows


def isolated_benches(args, report: dict, matmul_flop_s: float) -> None:
    """The Llama-8B GEMM shapes and the decode attention sweep, each printed as it finishes (a later failure
    loses nothing measured)."""
    report["gemm_m%d" % args.batch] = gemm_bench(args.batch, matmul_flop_s)
    for row in report["gemm_m%d" % args.batch]:
        print(row, flush=True)
    report["attention"] = attention_bench(args.batch, args.context, sweep=not args.no_sweep)
    for row in sorted(report["attention"], key=lambda r: r["us"])[:8] + \
            [r for r in report["attention"] if r.get("engine_default") or "splits" not in r or "rope_fused" in r]:
        print(row, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=768)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--transformers-forward", action="store_true", help="decode through transformers' modules")
    ap.add_argument("--json")
    ap.add_argument("--no-sweep", action="store_true", help="skip the 81-launch attention sweep")
    ap.add_argument("--model-geometry", default="llama-8b", help="the model's shape (batchgen/bench/geometries.py)")
    ap.add_argument("--engine-only", action="store_true",
                    help="skip the isolated GEMM and attention benches (their shapes are Llama-8B's)")
    ap.add_argument("--weights", default="bf16", choices=("bf16", "fp8", "fp8-channel"),
                    help="the layers' projections: bf16, or an FP8 checkpoint's (bench/fp8_weights.py); implies "
                         "--engine-only")
    ap.add_argument("--fp8-gemm", default="auto", choices=("auto", "blockwise", "triton", "splitk"),
                    help="engine.fp8_gemm: the FP8 block-scaled GEMM path")
    ap.add_argument("--deterministic", action="store_true",
                    help="profile engine.deterministic's step (batch-invariant kernels); implies --engine-only")
    ap.add_argument("--attention-in-engine", action="store_true",
                    help="time the decode attention on the engine's own cache and tables (attention_in_engine)")
    args = ap.parse_args()
    ceilings = measure_ceilings()
    report: dict = {"copy_TBps": ceilings.copy_bytes_s / 1e12, "batch": args.batch, "context": args.context,
                    "geometry": args.model_geometry, "deterministic": args.deterministic, "weights": args.weights,
                    "fp8_gemm": args.fp8_gemm}
    if not (args.engine_only or args.deterministic or args.weights != "bf16"):
        isolated_benches(args, report, ceilings.matmul_flop_s)
    model = build_model(geometry=args.model_geometry, weights=args.weights)
    engine = Engine(model, None, EngineConfig(max_num_seqs=args.batch, cuda_graphs=True, async_pipeline=False,
                                              compile=args.compile, deterministic=args.deterministic,
                                              fused_decoder=not args.transformers_forward, fp8_gemm=args.fp8_gemm))
    if args.deterministic:  # each kind of weight's GEMM, as the build's self-check chose it
        report["gemm_paths"] = engine.runner.decode_forward.linear.summary()
        print("GEMM paths:", report["gemm_paths"], flush=True)
    for p in seed_prompts(args.batch, args.context):
        engine.add_request(p, SamplingParams(max_new_tokens=4096, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    if args.attention_in_engine:
        report["attention_in_engine"] = attention_in_engine(engine, model.config.num_attention_heads)
        for row in report["attention_in_engine"]:
            print(row, flush=True)
    graphs = engine.runner.graphs
    bucket = graphs.bucket_for(args.batch)
    replay = graphs._graphs[bucket].replay
    report["graph_replay_ms"] = event_ms(replay, 20)
    report["engine_step_ms"] = event_ms(engine.step, 20)
    rows, kernel_us = kernel_table(replay)
    report["kernel_us_per_step"] = kernel_us
    report["kernels_per_step"] = sum(r[1] for r in rows)
    report["kernels"] = [{"name": n[:120], "per_step": c, "us": round(us, 1)} for n, c, us in rows]
    print(f"graph replay {report['graph_replay_ms']:.3f} ms, engine step {report['engine_step_ms']:.3f} ms, "
          f"kernel time {kernel_us / 1e3:.3f} ms in {report['kernels_per_step']} kernels", flush=True)
    for r in report["kernels"][:30]:
        print(f"{r['us']:9.1f} us {r['per_step']:5d}x  {r['name']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

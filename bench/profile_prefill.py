"""Where a prefill (mixed) step's time goes on the GPU, against its FLOP floor (Llama-3.1-8B geometry, random bf16
weights): the eager packed forward that serves every step with prompt tokens (a job's 17 mixed steps
took 12 % of its loop at 1.58x their prompt tokens' GEMM FLOPs; the mixed load's 2 M prompt tokens make it most
of that workload's gap to its floor).

Per shape, one step scheduled by the engine and run `--reps` times through `ModelRunner.execute` (the same K/V
slots rewritten each time): its wall time, its kernels by kind (GEMM, attention, sampling, other: torch profiler)
and the floor: the step's GEMM FLOPs (projections for every token, the LM head for its sampled rows) plus
its causal attention FLOPs, at the matmul rate measured in the same run.

    python3 bench/profile_prefill.py [--shapes 8192x68,8192x2048,2048x68,1450x1450/250x1365] [--json out.json]

A shape TOKENSxLEN is one step of TOKENS prompt tokens from prompts of LEN tokens (the last one cut short);
TOKENSxLEN/DxC adds D decode rows at context C (their prompts prefilled first): the mixed load's typical mixed
step is one ~1,450-token prompt beside ~250 decode rows at a median context of 1,365 (2026-12-02,
bench/results/2026-12-02-prefill-kernels-fp8-job.md);
5800x1450/250x1365 is the step that admitting four prompts at once would make (do bigger GEMMs pay for fewer,
larger mixed steps?). Its floor adds the decode rows' GEMM FLOPs (LM head included) and their K/V bytes at the copy
bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchgen.bench.geometries import decode_bytes  # noqa: E402
from batchgen.bench.job import kernel_kinds  # noqa: E402
from batchgen.bench.seed import build_model, measure_ceilings  # noqa: E402
from batchgen.engine.config import EngineConfig  # noqa: E402
from batchgen.engine.engine import Engine  # noqa: E402
from batchgen.sampling_params import SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def attention_flops(lengths: list[int], config) -> float:
    """Causal attention FLOPs of prompts of these lengths (computed from scratch): QK^T and PV over the lower
    triangle, 2 FLOPs a multiply-add, every layer."""
    cfg = config.get_text_config()
    width = cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    return sum(2 * 2 * (n * (n + 1) / 2) * width for n in lengths) * cfg.num_hidden_layers


def gemm_shapes(averages, reps: int) -> list[dict]:
    """The step's F.linear GEMMs by shape, from `prof.key_averages(group_by_input_shape=True)`: per (M, N, K) the
    calls and device ms a step and the rate reached (TFLOP/s), slowest total first. (aten::linear's input shapes:
    x [M, K] and the weight [N, K]; its device time holds the kernels it launched.)"""
    rows = []
    for avg in averages:
        shapes = getattr(avg, "input_shapes", None) or []
        if avg.key != "aten::linear" or len(shapes) < 2 or len(shapes[0]) != 2 or len(shapes[1]) != 2:
            continue
        (m, k), (n, _) = shapes[0], shapes[1]
        ms = avg.device_time_total / 1e3 / reps
        rows.append({"M": m, "N": n, "K": k, "calls": avg.count // reps, "ms": round(ms, 3),
                     "TFLOPs": round(2 * m * n * k * (avg.count / reps) / (ms * 1e-3) / 1e12, 1) if ms else None})
    return sorted(rows, key=lambda r: -r["ms"])


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """"TOKENSxLEN" or "TOKENSxLEN/DxC" -> (tokens, prompt length, decode rows, their context)."""
    prefill, _, decode = text.partition("/")
    try:
        tokens, length = (int(x) for x in prefill.split("x"))
        num_decode, context = (int(x) for x in decode.split("x")) if decode else (0, 0)
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not TOKENSxLEN or TOKENSxLEN/DxC") from None
    if min(tokens, length) < 1 or num_decode < 0 or (num_decode and context < 3):
        raise SystemExit(f"--shapes: {text!r}: tokens and length >= 1, decode rows >= 0 at a context >= 3")
    return tokens, length, num_decode, context


def profile_shape(model, tokens: int, length: int, reps: int, ceilings, num_decode: int = 0,
                  decode_context: int = 0) -> dict:
    lengths = [length] * (tokens // length) + ([tokens % length] if tokens % length else [])
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    sampled = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, ignore_eos=True)
    with Engine(model, None, EngineConfig(max_num_seqs=max(256, len(lengths) + num_decode),
                                          max_num_batched_tokens=max(tokens + num_decode, 8192),
                                          cuda_graphs=False)) as engine:
        runner = engine.runner
        if num_decode:  # prompts of context - 2 tokens, prefilled, then one decode step: at the profiled step a
            # decode row attends over `decode_context` tokens (its new one included), or a few more where its prompt
            # was done before the last prefill step (running rows decode in every step after their prefill: the
            # contexts spread over the prefill steps; the floor counts each row's own)
            budget = engine.config.max_num_batched_tokens
            outlast = -(-num_decode * decode_context // (budget - num_decode)) + 8  # tokens a row may decode early
            for i in range(num_decode):
                engine.add_request(torch.randint(3, vocab, (decode_context - 2,), generator=gen).tolist(),
                                   SamplingParams(max_new_tokens=outlast, temperature=0.7, top_p=0.9,
                                                  ignore_eos=True), request_id=f"decode-{i}")
            prefilling = True
            while prefilling:
                batch = engine.scheduler.schedule()
                prefilling = batch.num_prefill_tokens > 0
                engine.scheduler.update(batch, runner.execute(batch))
        for n in lengths:
            engine.add_request(torch.randint(3, vocab, (n,), generator=gen).tolist(), sampled)
        batch = engine.scheduler.schedule()  # every prompt whole (beside the decode rows): one step
        assert batch.num_prefill_tokens == tokens, (batch.num_prefill_tokens, tokens)
        assert batch.num_decode_tokens == num_decode, (batch.num_decode_tokens, num_decode)
        # each decode row's context at this step (its new token included), from its place in the batch
        contexts = sorted(s.start_pos + 1 for s in batch.seqs if s.request_id.startswith("decode-"))
        assert len(contexts) == num_decode and all(c >= decode_context for c in contexts), contexts
        for _ in range(2):  # builds and warm-up
            runner.execute(batch)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            runner.execute(batch)
        sync()
        wall_ms = 1e3 * (time.perf_counter() - t0) / reps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(reps):
                runner.execute(batch)
            sync()
        engine.scheduler.update(batch, runner.execute(batch))  # leave the engine consistent before close
    kinds, num_kernels = kernel_kinds(prof.events())
    top: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "batchgen.sample":
            top[e.name] += e.device_time / 1e3 / reps
    b = decode_bytes(model.config)
    rows, sampled_rows = tokens + num_decode, len(lengths) + num_decode
    # projections for every token, the LM head for the sampled rows; the weights read once if that is longer
    gemm_floor_s = max(b.gemm_s(rows, 0, ceilings, head=False) + b.gemm_s(sampled_rows, 0, ceilings)
                       - b.gemm_s(sampled_rows, 0, ceilings, head=False), b.weight_bytes() / ceilings.copy_bytes_s)
    # the prompts' causal attention FLOPs, the decode rows' K/V bytes
    attn_floor_s = (ceilings.gemm_s(attention_flops(lengths, model.config))
                    + sum(b.kv_bytes(c) for c in contexts) / ceilings.copy_bytes_s)
    floor_ms = 1e3 * (gemm_floor_s + attn_floor_s)
    return {"tokens": tokens, "prompt_len": length, "num_prompts": len(lengths), "num_decode": num_decode,
            "decode_context": decode_context, "decode_contexts_min_median_max":
                [contexts[0], contexts[len(contexts) // 2], contexts[-1]] if contexts else None,
            "wall_ms": round(wall_ms, 2),
            "kernel_ms": {k: round(v / 1e3 / reps, 2) for k, v in kinds.items()},
            "kernels": num_kernels // reps, "gemm_floor_ms": round(1e3 * gemm_floor_s, 2),
            "attention_floor_ms": round(1e3 * attn_floor_s, 2), "floor_ms": round(floor_ms, 2),
            "x_floor": round(wall_ms / floor_ms, 3),
            "top_kernels_ms": {k[:90]: round(v, 3) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:10]},
            "gemm_shapes": gemm_shapes(prof.key_averages(group_by_input_shape=True), reps)}


def shape_label(row: dict) -> str:
    """A profiled row's shape as --shapes writes it (TOKENSxLEN[/DxC])."""
    decode = f"/{row['num_decode']}x{row['decode_context']}" if row["num_decode"] else ""
    return f"{row['tokens']}x{row['prompt_len']}{decode}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x68,8192x2048,2048x68,1450x1450/250x1365,5800x1450/250x1365",
                    help="TOKENSxLEN[/DxC], comma-separated (module docstring)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    shapes = [parse_shape(shape) for shape in args.shapes.split(",")]  # every shape checked before a model is built
    ceilings = measure_ceilings()
    model = build_model()
    rows = []
    for tokens, length, num_decode, context in shapes:
        rows.append(profile_shape(model, tokens, length, args.reps, ceilings, num_decode, context))
        print(json.dumps(rows[-1]), flush=True)
    print(f"matmul {ceilings.matmul_flop_s / 1e12:.0f} TFLOP/s, copy {ceilings.copy_bytes_s / 1e12:.2f} TB/s")
    print(f"{'shape':>20} {'wall ms':>8} {'floor ms':>9} {'x floor':>8} {'gemm':>7} {'attn':>7} {'other':>7} kernels")
    for r in rows:
        k = r["kernel_ms"]
        print(f"{shape_label(r):>20} {r['wall_ms']:>8.2f} {r['floor_ms']:>9.2f} {r['x_floor']:>8.3f} {k.get('gemm', 0):>7.2f} "
              f"{k.get('attention', 0):>7.2f} {k.get('other', 0) + k.get('sampling', 0):>7.2f} "
              f"{r['kernels']}")
    for r in rows:  # where the GEMM time goes, by shape (the rate against the measured matmul rate)
        for g in r["gemm_shapes"][:6]:
            print(f"{shape_label(r)}: GEMM M {g['M']} N {g['N']} K {g['K']} x{g['calls']}: "
                  f"{g['ms']} ms, {g['TFLOPs']} TFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"matmul_TFLOPs": ceilings.matmul_flop_s / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""The split-K skinny GEMM (kernels/skinny_gemm.py, engine.decode_gemm: triton_splitk) against F.linear (cuBLASLt, as
the decode graphs capture it) at the decode projections of a few geometries, bf16, M = 16 / 32 / 64.

    python3 bench/skinny_gemm.py [--geometries llama-8b,phi3-mini,qwen2-7b,starcoder2-3b] [--rows 16,32,64]
                                 [--sweep] [--json out.json]

Shapes per geometry (batchgen/bench/geometries.py): the fused qkv [(H + 2 Hkv) D, E], o [E, H D], the fused gate_up
[2 I, E] (Starcoder2: c_fc [I, E]) and down [E, I] (c_proj). Times: µs per call from CUDA-graph replay
(bench/fp8_gemm.py time_graph_ms: 20 calls in one graph, weight copies rotated over more than L2, median over
replays): what a graphed decode step pays. `floor`: the weight's bytes at the copy bandwidth
(batchgen.bench.seed.measure_ceilings), the bound a weight stream can reach; x/floor columns are time / floor.
`skinny`: skinny_linear with its default config (skinny_config; + the reduce kernel where it splits). --sweep also
times a small grid of explicit configs (block_n x block_k x splits x stages) and prints the best per shape.
Errors: max |out - ref| / max |ref|, ref = F.linear in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.fp8_gemm import L2_BYTES, rel_err, time_graph_ms  # noqa: E402
from batchgen.bench.geometries import PLAIN_MLP, model_config  # noqa: E402
from batchgen.kernels.skinny_gemm import SkinnyConfig, skinny_config, skinny_linear  # noqa: E402
from batchgen.kernels.splitk_common import num_sms, split_sizes  # noqa: E402

GEOMETRIES = ("llama-8b", "phi3-mini", "qwen2-7b", "starcoder2-3b")
SWEEP_TILES = ((64, 128, 4), (64, 128, 5), (64, 256, 3), (64, 256, 4), (128, 128, 4), (128, 64, 5))  # bn, bk, stages
SWEEP_MAX_PROGRAMS = 2048


def projection_shapes(geometry: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one layer's decode GEMMs (fused as the fused decoders fuse them)."""
    cfg = model_config(geometry).get_text_config()
    e, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or e // heads
    i = cfg.intermediate_size
    if cfg.model_type in PLAIN_MLP:
        mlp = {"c_fc": (i, e), "c_proj": (e, i)}
    else:
        mlp = {"gate_up": (2 * i, e), "down": (e, i)}
    return {"qkv": ((heads + 2 * kv_heads) * d, e), "o": (e, heads * d), **mlp}


def sweep_configs(m: int, n: int, k: int, sms: int) -> list[SkinnyConfig]:
    """Explicit configs: SWEEP_TILES x the split counts dividing K's blocks with sms..SWEEP_MAX_PROGRAMS programs."""
    out = []
    for block_n, block_k, stages in SWEEP_TILES:
        blocks = -(-k // block_k)
        for splits in range(1, min(blocks, 32) + 1):
            programs = -(-n // block_n) * split_sizes(blocks, splits)[1]
            if blocks % splits == 0 and (sms <= programs <= SWEEP_MAX_PROGRAMS or splits == 1):
                out.append(SkinnyConfig(block_n, block_k, splits, 4, stages))
    return out


def bench_shape(geometry: str, name: str, n: int, k: int, rows: list[int], sweep: bool, copy_bw: float) -> list[dict]:
    g = torch.Generator("cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    weights = [w] + [w.clone() for _ in range(max(1, -(-L2_BYTES // (2 * n * k)) - 1))]
    floor_us = 2 * n * k / copy_bw * 1e6
    sms = num_sms(0)
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = F.linear(x.float(), w.float())
        default = skinny_config(m, n, k, 2, sms)
        r = {"geometry": geometry, "shape": name, "N": n, "K": k, "M": m, "floor_us": floor_us,
             "default": list(default), "blas_err": rel_err(F.linear(x, w), ref),
             "skinny_err": rel_err(skinny_linear(x, w), ref)}
        r["blas_us"] = 1e3 * time_graph_ms(lambda i: F.linear(x, weights[i]), len(weights))
        r["skinny_us"] = 1e3 * time_graph_ms(lambda i: skinny_linear(x, weights[i]), len(weights))
        if sweep:
            timed = {}
            for cfg in dict.fromkeys(sweep_configs(m, n, k, sms) + [default]):
                try:
                    assert rel_err(skinny_linear(x, w, None, cfg), ref) < 1e-2
                    timed[cfg] = 1e3 * time_graph_ms(lambda i: skinny_linear(x, weights[i], None, cfg),
                                                     len(weights), calls=10, replays=5)
                except Exception as e:  # a config the GPU cannot hold (shared memory), or wrong: skipped
                    print(f"  {geometry} {name} M={m} {tuple(cfg)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            if timed:
                best = min(timed, key=timed.get)
                r.update(best=list(best), best_us=timed[best],
                         all={",".join(map(str, c)): round(t, 2) for c, t in sorted(timed.items(), key=lambda kv: kv[1])})
        out.append(r)
        print(json.dumps(r), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometries", default=",".join(GEOMETRIES))
    parser.add_argument("--rows", default="16,32,64", help="M values (each <= 64)")
    parser.add_argument("--sweep", action="store_true", help="also time a small grid of explicit configs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    from batchgen.bench.seed import measure_ceilings

    t0 = time.time()
    rows_m = [int(v) for v in args.rows.split(",") if v]
    copy_bw = measure_ceilings().copy_bytes_s
    device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, copy {copy_bw / 1e12:.2f} TB/s"
    print(device, flush=True)
    results = []
    for geometry in args.geometries.split(","):
        for name, (n, k) in projection_shapes(geometry).items():
            results += bench_shape(geometry, name, n, k, rows_m, args.sweep, copy_bw)
            torch.cuda.empty_cache()  # the shape's weight copies
            if args.json:  # after every shape: a run cut by its time limit keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"device": device, "rows": results}, f, indent=1)
    print("\nµs per call (CUDA-graph replay), bf16; floor: weight bytes at the copy bandwidth")
    print(f"{'geometry':<14}{'shape':<8}{'N':>7}{'K':>7}{'M':>4}{'floor':>8}{'blas':>8}{'skinny':>8}{'best':>8}"
          f"{'blas/fl':>8}{'sk/fl':>7}{'best/fl':>8}  best config (block_n, block_k, splits, warps, stages)")
    for r in results:
        best = r.get("best_us", float("nan"))
        print(f"{r['geometry']:<14}{r['shape']:<8}{r['N']:>7}{r['K']:>7}{r['M']:>4}{r['floor_us']:>8.1f}"
              f"{r['blas_us']:>8.1f}{r['skinny_us']:>8.1f}{best:>8.1f}{r['blas_us'] / r['floor_us']:>8.2f}"
              f"{r['skinny_us'] / r['floor_us']:>7.2f}{best / r['floor_us']:>8.2f}  {tuple(r.get('best', ()))}")
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()

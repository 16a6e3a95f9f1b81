"""engine.deterministic's GEMMs on the GPU against the default mode's, at the Llama-3.1-8B shapes (qkv 6144x4096,
o 4096x4096, gate_up 28672x4096, down 4096x14336, lm_head 128256x4096) and M = 32 (W1's decode), 256 (the job
workload's decode) and 512 (prefill), bf16.

    python3 bench/invariant_gemm.py [--rows 32,256,512] [--shapes qkv,o,gate_up,down,lm_head] [--json out.json]

Variants per (shape, M): `default`: F.linear on cuBLASLt (what the default mode's decode graphs run); `triton`: the
Triton batch-invariant GEMM (kernels/invariant_matmul.matmul_invariant, the deterministic mode's GEMM before the
fixed-row path, now its fallback); `fixed_lt`: the fixed-row path as the engine runs it (cuBLASLt, 256 rows a call:
kernels/fixed_row_gemm.cublas_fixed_rows); `fixed_cublas`: the same on cuBLAS (were BLAS_LIBRARY switched).
`check_lt`, `check_cublas`: the self-check's verdict for the weight on each library (kernels/invariant_linear.
row_dependence: "ok", or why the engine would run the Triton GEMM for it; the engine checks BLAS_LIBRARY's).

Times: ms per call from CUDA-graph replay (bench/fp8_gemm.py time_graph_ms: 20 calls in one graph, weight copies
rotated over more than L2, median over replays), no Python or launch overhead: what a graphed decode step pays.
Then, per M and variant, one 8B decode step's GEMMs: 32 x (qkv + o + gate_up + down) + lm_head.
Expect (H200): fixed_lt = default at M = 256 (the same cuBLASLt call); at M = 32 fixed_lt ~ default's M = 256
time plus ~10 µs of pad / copy kernels per GEMM; at M = 512 two 256-row calls + copies.
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
from batchgen.kernels.invariant.fixed_row_gemm import fixed_row_linear, preferred_blas  # noqa: E402
from batchgen.kernels.invariant.linear import row_dependence  # noqa: E402
from batchgen.kernels.invariant.matmul import matmul_invariant  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}  # calls in one 8B decode step
VARIANTS = ("default", "triton", "fixed_lt", "fixed_cublas")


def on_library(library: str, fn):
    """fn with torch's BLAS back end pinned to `library` while it runs (at capture: what the graph records)."""
    def run(*args):
        with preferred_blas(library):
            return fn(*args)
    return run


def bench_shape(name: str, n: int, k: int, rows: list[int]) -> list[dict]:
    g = torch.Generator("cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    weights = [w] + [w.clone() for _ in range(max(1, -(-L2_BYTES // (2 * n * k)) - 1))]
    checks = {lib: row_dependence(on_library(lib, fixed_row_linear), w, None) or "ok" for lib in ("cublaslt", "cublas")}
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        calls = {
            "default": on_library("cublaslt", lambda i: F.linear(x, weights[i])),
            "triton": lambda i: matmul_invariant(x, weights[i]),
            "fixed_lt": on_library("cublaslt", lambda i: fixed_row_linear(x, weights[i])),
            "fixed_cublas": on_library("cublas", lambda i: fixed_row_linear(x, weights[i])),
        }
        ref = calls["default"](0)
        r = {"shape": name, "N": n, "K": k, "M": m, "check_lt": checks["cublaslt"], "check_cublas": checks["cublas"]}
        for key, fn in calls.items():
            try:
                r[f"{key}_err"] = rel_err(fn(0), ref)
                r[f"{key}_ms"] = time_graph_ms(fn, len(weights))
            except Exception as e:  # reported, not fatal: the other variants still run
                print(f"  {name} M={m} {key}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                r[f"{key}_ms"] = r[f"{key}_err"] = float("nan")
            r[f"{key}_TBps"] = 2 * n * k / (r[f"{key}_ms"] / 1e3) / 1e12
        out.append(r)
        print(json.dumps(r), flush=True)
    return out


def step_totals(rows: list[dict]) -> list[dict]:
    """Per M: one 8B decode step's GEMM ms per variant (only where every shape of the step was timed)."""
    out = []
    for m in sorted({r["M"] for r in rows}):
        at_m = {r["shape"]: r for r in rows if r["M"] == m}
        if set(at_m) != set(PER_STEP):
            continue
        out.append({"M": m, **{f"{v}_ms": sum(PER_STEP[s] * at_m[s][f"{v}_ms"] for s in PER_STEP) for v in VARIANTS}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="32,256,512")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    t0 = time.time()
    device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    print(device, flush=True)
    rows_m = [int(v) for v in args.rows.split(",") if v]
    rows: list[dict] = []
    for name in args.shapes.split(","):
        rows += bench_shape(name, *SHAPES[name], rows_m)
        torch.cuda.empty_cache()  # the shape's weight copies (up to 2 GB for lm_head) go back
        if args.json:  # after every shape: a run cut by its time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"device": device, "rows": rows, "step": step_totals(rows)}, f, indent=1)
    print("\nms per call (CUDA-graph replay); x: / default")
    print(f"{'shape':<8}{'M':>5}" + "".join(f"{v:>13}" for v in VARIANTS) + f"{'triton x':>10}{'fixed_lt x':>11}"
          f"{'fixed_lt err':>13}  check (cublaslt / cublas)")
    for r in rows:
        print(f"{r['shape']:<8}{r['M']:>5}" + "".join(f"{r[f'{v}_ms']:>13.4f}" for v in VARIANTS)
              + f"{r['triton_ms'] / r['default_ms']:>10.2f}{r['fixed_lt_ms'] / r['default_ms']:>11.2f}"
              f"{r['fixed_lt_err']:>13.1e}  {r['check_lt']} / {r['check_cublas']}")
    steps = step_totals(rows)
    if steps:
        print("\none 8B decode step's GEMMs, ms (32 x (qkv + o + gate_up + down) + lm_head)")
        print(f"{'M':>5}" + "".join(f"{v:>13}" for v in VARIANTS))
        for s in steps:
            print(f"{s['M']:>5}" + "".join(f"{s[f'{v}_ms']:>13.3f}" for v in VARIANTS))
    print(f"\n({time.time() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": rows, "step": steps}, f, indent=1)


if __name__ == "__main__":
    main()

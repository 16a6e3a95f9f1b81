"""The projection GEMMs of a geometry at the row counts engine steps run, with cuBLAS and cuBLASLt, against the
matmul rate the benchmarks' floors use (an 8192³ bf16 GEMM timed for a few milliseconds), with the GPU's SM clock
and power drawn while each ran.

Why: a prefill step's GEMMs ran at 1.10-1.16× their FLOPs at 5,800-8,192 rows (664-722 TFLOP/s) but at 1.03× at
1,700 rows (725-777) on 2026-12-05 (one H100, `bench/profile_prefill.py`; matmul rate 794 TFLOP/s). Either the
library picks slower tiles at large M (then the other library, or another shape split, is faster), or a long GEMM
run lowers the clock (then nothing in software closes it, and the floor's rate is a burst's). Each shape is timed
twice: a burst (`--burst-ms` of work, after an idle second) and sustained (`--sustain-ms` of back-to-back calls);
the clock and power are read while the sustained run is on the GPU.

    python3 bench/gemm_shapes.py [--geometry llama-8b] [--rows 1024,1700,4096,8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchgen.bench.geometries import GEOMETRIES  # noqa: E402
from batchgen.kernels.invariant.fixed_row_gemm import preferred_blas  # noqa: E402


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the layer's projections: weights [N, K], y = x @ w.T."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def gpu_clock_and_power() -> tuple[float | None, float | None]:
    """The SM clock (MHz) and board power (W) now, from nvidia-smi (None, None where it cannot be read)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                              "-i", "0"], capture_output=True, text=True, timeout=10).stdout
        clock, power = (float(v) for v in out.strip().splitlines()[0].split(","))
        return clock, power
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None, None


def timed(fn, target_ms: float, probe: bool = False) -> tuple[float, float | None, float | None]:
    """(ms a call, clock MHz, power W) over about `target_ms` of back-to-back calls; with `probe`, the clock and
    power are read while the calls run (they are queued first, the host then reads nvidia-smi)."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    iters = max(3, int(target_ms / max(s.elapsed_time(e), 1e-3)))
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    clock, power = gpu_clock_and_power() if probe else (None, None)
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters, clock, power


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", default="llama-8b", choices=sorted(GEOMETRIES))
    ap.add_argument("--rows", default="1024,1700,4096,8192", help="row counts M (comma-separated)")
    ap.add_argument("--libraries", default="cublas,cublaslt")
    ap.add_argument("--burst-ms", type=float, default=20.0)
    ap.add_argument("--sustain-ms", type=float, default=1500.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    shapes = projection_shapes(GEOMETRIES[args.geometry][1])
    rows = [int(r) for r in args.rows.split(",")]
    libraries = args.libraries.split(",")
    records = []

    def run(name: str, m: int, n: int, k: int) -> None:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        flop = 2 * m * n * k
        for lib in libraries:
            with preferred_blas(lib):
                fn = (lambda: a @ w.T) if name != "reference" else (lambda: a @ w)
                time.sleep(1.0)  # idle: the burst starts cool, as the floors' rate measurement does
                burst_ms, _, _ = timed(fn, args.burst_ms)
                sustained_ms, clock, power = timed(fn, args.sustain_ms, probe=True)
            rec = {"name": name, "M": m, "N": n, "K": k, "library": lib,
                   "burst_TFLOPs": flop / burst_ms / 1e9, "sustained_TFLOPs": flop / sustained_ms / 1e9,
                   "sm_clock_MHz": clock, "power_W": power}
            records.append(rec)
            print(f"{name:>9} M {m:>5} N {n:>5} K {k:>5} {lib:>8}: burst {rec['burst_TFLOPs']:6.1f} TFLOP/s, "
                  f"sustained {rec['sustained_TFLOPs']:6.1f} ({clock} MHz, {power} W)", flush=True)

    run("reference", 8192, 8192, 8192)  # the floors' matmul rate: a @ b of two 8192² matrices
    for m in rows:
        for name, (n, k) in shapes.items():
            run(name, m, n, k)
    ref = {r["library"]: r["burst_TFLOPs"] for r in records if r["name"] == "reference"}
    print(f"\n{'shape':>9} {'M':>5} " + " ".join(f"{lib + ' x rate (burst/sust.)':>32}" for lib in libraries))
    for m in rows:
        for name in shapes:
            cells = []
            for lib in libraries:
                r = next(x for x in records if x["name"] == name and x["M"] == m and x["library"] == lib)
                rate = ref[libraries[0]]
                cells.append(f"{rate / r['burst_TFLOPs']:.3f} / {rate / r['sustained_TFLOPs']:.3f}")
            print(f"{name:>9} {m:>5} " + " ".join(f"{c:>32}" for c in cells))
    print(f"(ratios against the burst rate of the 8192³ GEMM with {libraries[0]}: {ref[libraries[0]]:.1f} TFLOP/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "geometry": args.geometry, "records": records}, f,
                      indent=1)


if __name__ == "__main__":
    main()

"""FP8 GEMMs on the GPU: numerics against the torch references and time against bf16, at the Llama-3.1-8B layer
shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336).

    python3 bench/fp8_gemm.py [--rows 32,256,512] [--json out.json] [--sweep [--sweep-rows 16,32,64,128,256,512]]

Variants per (shape, M): bf16 F.linear (cuBLASLt); `blk`: fp8 block 128x128, the group quantiser + the Triton
GEMM (block_scaled_matmul: the block path where cuBLASLt has no block-wise scaling); `gemm`: the Triton GEMM alone
over pre-quantised activations (blk - gemm = the quantiser); `cublas`: the same quantiser + torch._scaled_mm with
1x128 x 128x128 block-wise scales (the default block path where torch/cuBLASLt supports it: sm90, CUDA >= 12.9);
`smm`: fp8 per-channel, per-token quantiser + torch._scaled_mm row-wise (the default per-channel path); `chT`: fp8
per-channel through the Triton path (per-channel weights with fp16/fp32 activations); `splitk`: fp8 block 128x128,
the group quantiser + the split-K GEMM of kernels/fp8/splitk.py with its default config (+ its reduction kernel
where it splits; the default path at M <= 32). Each variant calls its kernel functions directly, whatever
kernels/fp8_gemm.gemm_path would pick.

Times, ms per call, two ways: `graph`: CALLS calls captured in one CUDA graph, replays timed with CUDA events,
median / CALLS (how the decoders run: no Python or launch overhead); `eager`: CUDA events around one Python call
(what the first version of this script reported: at small M it is launch-bound). Each call reads its weight
from HBM: weight copies are rotated over more than the L2 cache. Errors: max |out - ref| / max |ref|, ref = the
emulated W8A8 reference (same quantisation in fp32).

--sweep times the Triton GEMM (activations quantised once, outside the timing) over a few launch configs per
(shape, M) with graph replays (explicit `config=` arguments), prints the best per (shape, M), and its entries for
batchgen/kernels/fp8/gemm_launches.json (commit only the buckets where the best beats the default: an M above a
shape's largest listed bucket takes the default configs); and the split-K GEMM over (BLOCK_N, splits, warps,
stages, TMA) (SPLITK_TILES x split counts at M <= 64; above, SPLITK_TILES_LARGE_M x row tiles of 64 and 128; splits
do not recompile), its best per (shape, M) printed beside the Triton GEMM's and the cuBLAS block-wise GEMM alone,
then the 'splitk' entries of that file (the rows up to which split-K's default config beat cuBLAS block-wise at
every swept M above SPLITK_MAX_ROWS). ~2-3 minutes on an H200 at M <= 64, mostly Triton
compiles; ~2 more a swept M above 64.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from batchgen.bench.graph_timing import median_replay_ms
from batchgen.kernels.fp8 import gemm as fp8_gemm
from batchgen.kernels.fp8.blockwise import (blockwise_scaled_mm, blockwise_scaled_mm_fits,
                                            blockwise_scaled_mm_supported, blockwise_unsupported_reason)
from batchgen.kernels.fp8.gemm import GemmConfig, block_scaled_matmul, gemm_config, rowwise_scaled_mm, w8a8_matmul
from batchgen.kernels.fp8.quant import linear_ref, quantize_groups, quantize_weight
from batchgen.kernels.fp8.splitk import SplitKConfig, split_sizes, splitk_config, splitk_matmul, splitk_scaled_matmul
from batchgen.kernels.fp8.splitk_common import block_m_for

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
L2_BYTES = 256 << 20  # rotate weight copies over more than this (H200 L2: 50 MB)
CALLS = 20  # calls per captured graph
SMALL = [GemmConfig(*c) for c in ((16, 32, 8, 4, 4), (16, 64, 8, 4, 4), (16, 64, 8, 4, 5), (16, 128, 8, 4, 4),
                                  (32, 64, 8, 4, 4), (32, 128, 8, 4, 4), (64, 64, 8, 4, 4), (64, 128, 8, 4, 4))]
LARGE = [GemmConfig(*c) for c in ((64, 64, 8, 4, 3), (64, 128, 8, 4, 3), (64, 128, 8, 4, 4), (128, 64, 8, 4, 3),
                                  (128, 128, 8, 8, 3), (64, 256, 8, 8, 3), (128, 256, 8, 8, 3))]

# split-K sweep: (BLOCK_N, warps, stages, TMA weight loads) tiles x every split count that divides K's scale blocks
# into 132 to 1600 programs (at most SPLITK_MAX_SPLITS; splits are a runtime argument: one compile per tile,
# BLOCK_M, SPLITS of the reduction)
SPLITK_TILES = ((32, 4, 4, False), (32, 4, 6, False), (64, 4, 4, False), (64, 4, 6, False), (128, 4, 4, False),
                (128, 8, 4, False), (64, 4, 4, True), (64, 4, 6, True), (128, 4, 4, True), (128, 8, 6, True))
# above 64 rows (the FP8 job's 256-512) fewer tiles, each with row tiles of 64 and of 128 (BLOCK_M 128 x
# BLOCK_N 128 x 128-byte K tiles over 4 stages: 128 KiB of shared memory, within a Hopper SM's 227)
SPLITK_TILES_LARGE_M = ((64, 4, 4, True), (64, 8, 4, True), (128, 4, 4, True), (128, 8, 4, True), (64, 4, 4, False),
                        (128, 8, 4, False))
SPLITK_BLOCK_M_LARGE = (64, 128)
SPLITK_MAX_SPLITS = 16


def splitk_sweep_configs(m: int, n: int, k: int) -> list[SplitKConfig]:
    blocks = -(-k // 128)
    tiles = [(*t, 0) for t in SPLITK_TILES] if m <= 64 else \
        [(*t, bm) for t in SPLITK_TILES_LARGE_M for bm in SPLITK_BLOCK_M_LARGE]
    out = []
    for block_n, warps, stages, tma, block_m in tiles:
        for splits in range(1, min(blocks, SPLITK_MAX_SPLITS) + 1):
            programs = -(-n // block_n) * split_sizes(blocks, splits)[1] * -(-m // (block_m or 64))
            if blocks % splits == 0 and (132 <= programs <= 1600 or splits == 1):
                out.append(SplitKConfig(block_n, splits, warps, stages, tma, block_m))
    return out


def splitk_shape_rows(sweeps: list[dict], swept_rows: list[int], min_rows: int) -> dict[tuple[int, int], int]:
    """fp8_gemm.SPLITK_SHAPE_ROWS from a sweep over swept_rows: per (N, K), the largest swept M above min_rows at
    which the split-K GEMM's default config beat cuBLASLt block-wise alone, at that M and at every swept M between
    min_rows and it (the table routes every row count up to it: an M with no figure for either is a loss); shapes
    where it never did are left out. Only as good as swept_rows is dense: sweep 64 and 128 before 256."""
    figures = {(s["N"], s["K"], s["M"]): s for s in sweeps}
    table = {}
    for n, k in dict.fromkeys((s["N"], s["K"]) for s in sweeps):
        for m in sorted(r for r in swept_rows if r > min_rows):
            s = figures.get((n, k, m), {})
            if not s.get("splitk_default_ms", float("nan")) < s.get("cublas_alone_ms", float("nan")):
                break  # slower, or not measured (NaN compares false)
            table[(n, k)] = m
    return table


def sweep_configs(m: int) -> list[GemmConfig]:
    """The configs --sweep tries at M rows: BLOCK_M at most M's power of two (>= 16)."""
    cap = max(16, 1 << (m - 1).bit_length())
    return [c for c in (SMALL if m <= 64 else LARGE) if c.block_m <= cap]


def time_eager_ms(fn, copies: int, iters: int = 30) -> float:
    for i in range(3):
        fn(i % copies)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        fn(i % copies)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_graph_ms(fn, copies: int, calls: int = CALLS, replays: int = 10) -> float:
    """Median over replays of one CUDA graph of `calls` calls (weight copies rotated), per call."""
    for i in range(2):
        fn(i % copies)  # compiles / autotunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fn(i % copies)
    torch.cuda.current_stream().wait_stream(stream)
    ms = median_replay_ms(graph, calls, replays)
    del graph
    return ms


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def bench_shape(name: str, n: int, k: int, rows: list[int], sweep_rows: list[int] | None, cublas: bool,
                sweeps: list[dict]) -> list[dict]:
    g = torch.Generator("cuda").manual_seed(0)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    copies = max(2, -(-L2_BYTES // (n * k)))  # fp8 bytes per copy: n k
    block = [quantize_weight(w16, 128, 128) for _ in range(copies)]
    channel = [quantize_weight(w16, None, None) for _ in range(copies)]
    bf16 = [w16.clone() for _ in range(max(2, copies // 2))]
    use_cublas = cublas and blockwise_scaled_mm_fits(torch.bfloat16, n, k, 128, 128)
    out_rows = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        xq, xs = quantize_groups(x, 128)
        (wb, sb), (wc, sc) = block[0], channel[0]
        r = {"shape": name, "N": n, "K": k, "M": m, "config": list(gemm_config(m, n, k, fp8_gemm._num_sms(0)))}
        ref_b = linear_ref(x, wb, sb, 128, 128, act_group=128)
        r["blk_err"] = rel_err(block_scaled_matmul(x, wb, sb, 128, 128), ref_b)
        r["blk_err_vs_dequant_ref"] = rel_err(block_scaled_matmul(x, wb, sb, 128, 128), linear_ref(x, wb, sb, 128, 128))
        r["smm_err"] = rel_err(rowwise_scaled_mm(x, wc, sc.view(1, -1)), linear_ref(x, wc, sc, 1, None, act_group=k))
        r["chT_err"] = rel_err(block_scaled_matmul(x, wc, sc, 1, None), linear_ref(x, wc, sc, 1, None, act_group=128))
        variants = {
            "bf16": (lambda i: F.linear(x, bf16[i % len(bf16)]), len(bf16), 2),
            "blk": (lambda i: block_scaled_matmul(x, *block[i], 128, 128), copies, 1),
            "gemm": (lambda i: w8a8_matmul(xq, xs, *block[i], 128, 128, torch.bfloat16), copies, 1),
            "smm": (lambda i: rowwise_scaled_mm(x, channel[i][0], channel[i][1].view(1, -1)), copies, 1),
            "chT": (lambda i: block_scaled_matmul(x, *channel[i], 1, None), copies, 1),
        }
        if use_cublas:
            r["cublas_err"] = rel_err(blockwise_scaled_mm(x, wb, sb), ref_b)
            variants["cublas"] = (lambda i: blockwise_scaled_mm(x, *block[i]), copies, 1)
        # split-K at every M: above SPLITK_MAX_ROWS it is what fp8_gemm.SPLITK_SHAPE_ROWS would route a shape to
        r["splitk_config"] = list(splitk_config(m, n, k, 128, fp8_gemm._num_sms(0)))
        r["splitk_err"] = rel_err(splitk_scaled_matmul(x, wb, sb, 128, 128), ref_b)
        variants["splitk"] = (lambda i: splitk_scaled_matmul(x, *block[i], 128, 128), copies, 1)
        for key, (fn, ncopies, bytes_per) in variants.items():
            try:
                r[f"{key}_graph_ms"] = time_graph_ms(fn, ncopies)
                r[f"{key}_eager_ms"] = time_eager_ms(fn, ncopies)
            except Exception as e:  # reported, not fatal: the other variants still run
                print(f"  {name} M={m} {key}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                r[f"{key}_graph_ms"] = r[f"{key}_eager_ms"] = float("nan")
            r[f"{key}_TBps"] = n * k * bytes_per / (r[f"{key}_graph_ms"] / 1e3) / 1e12
            r[f"{key}_TFLOPs"] = 2 * m * n * k / (r[f"{key}_graph_ms"] / 1e3) / 1e12
        out_rows.append(r)
        print(json.dumps(r), flush=True)
    for m in sweep_rows or []:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        xq, xs = quantize_groups(x, 128)
        ref = linear_ref(x, block[0][0], block[0][1], 128, 128, act_group=128)
        default = gemm_config(m, n, k, fp8_gemm._num_sms(0))
        timed = {}
        for cfg in dict.fromkeys(sweep_configs(m) + [default]):
            try:
                err = rel_err(w8a8_matmul(xq, xs, *block[0], 128, 128, torch.bfloat16, config=cfg), ref)
                assert err < 1e-2, err
                timed[cfg] = time_graph_ms(lambda i: w8a8_matmul(xq, xs, *block[i], 128, 128, torch.bfloat16,
                                                                 config=cfg), copies, calls=10, replays=5)
            except Exception as e:  # a config the GPU cannot hold (shared memory), or wrong: skipped
                print(f"  {name} M={m} config {tuple(cfg)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        if not timed:
            continue
        best = min(timed, key=timed.get)
        s = {"shape": name, "N": n, "K": k, "M": m, "best": list(best), "best_ms": timed[best],
             "default": list(default), "default_ms": timed.get(default, float("nan")),
             "best_TBps": n * k / (timed[best] / 1e3) / 1e12,
             "all": {",".join(map(str, c)): round(t, 5) for c, t in sorted(timed.items(), key=lambda kv: kv[1])}}
        s.update(sweep_splitk(name, n, k, m, xq, xs, block, copies, ref))
        sweeps.append(s)
        print(json.dumps(s), flush=True)
    del block, channel, bf16
    torch.cuda.empty_cache()
    return out_rows


def sweep_splitk(name: str, n: int, k: int, m: int, xq, xs, block, copies: int, ref) -> dict:
    """The split-K GEMM alone over splitk_sweep_configs (and its default), graph replays; then cuBLAS block-wise
    _scaled_mm alone over the same quantised activations (where supported), for comparison."""
    default = splitk_config(m, n, k, 128, fp8_gemm._num_sms(0))
    default = default._replace(block_m=block_m_for(m)) if m > 64 else default  # the sweep's spelling: timed once
    timed = {}
    for cfg in dict.fromkeys(splitk_sweep_configs(m, n, k) + [default]):
        try:
            err = rel_err(splitk_matmul(xq, xs, *block[0], 128, 128, torch.bfloat16, config=cfg), ref)
            assert err < 1e-2, err
            timed[cfg] = time_graph_ms(lambda i: splitk_matmul(xq, xs, *block[i], 128, 128, torch.bfloat16,
                                                               config=cfg), copies, calls=10, replays=5)
        except Exception as e:
            print(f"  {name} M={m} splitk {tuple(cfg)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    if not timed:
        return {}
    best = min(timed, key=timed.get)
    out = {"splitk_best": list(best), "splitk_best_ms": timed[best], "splitk_default": list(default),
           "splitk_default_ms": timed.get(default, float("nan")),
           "splitk_best_TBps": n * k / (timed[best] / 1e3) / 1e12,
           "splitk_all": {",".join(map(str, c)): round(t, 5) for c, t in sorted(timed.items(), key=lambda kv: kv[1])}}
    for tma in (False, True):  # the best with plain pointer loads of the weight and with TMA descriptor loads
        times = [t for c, t in timed.items() if c.tma == tma]
        out[f"splitk_best_{'tma' if tma else 'plain'}_ms"] = min(times) if times else float("nan")
    if blockwise_scaled_mm_fits(torch.bfloat16, n, k, 128, 128) and blockwise_scaled_mm_supported(0):
        out["cublas_alone_ms"] = time_graph_ms(lambda i: torch._scaled_mm(
            xq, block[i][0].t(), scale_a=xs, scale_b=block[i][1].t(), out_dtype=torch.bfloat16), copies, 10, 5)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--rows", default="32,256,512", help="M values of the variant table ('' for none)")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-rows", default="16,32,64,128,256,512")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    t0 = time.time()
    rows_m = [int(v) for v in args.rows.split(",") if v]
    sweep_m = [int(v) for v in args.sweep_rows.split(",") if v] if args.sweep else None
    cublas = blockwise_scaled_mm_supported(0)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuBLASLt block-wise _scaled_mm: {'yes' if cublas else 'no: ' + blockwise_unsupported_reason(0)}",
          flush=True)
    rows, sweeps = [], []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        rows += bench_shape(name, n, k, rows_m, sweep_m, cublas, sweeps)
        if args.json:  # after every shape: a run cut by its time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "sweep": sweeps}, f, indent=1)
    keys = ["bf16", "blk", "gemm", "cublas", "splitk", "smm", "chT"]
    if rows:
        for mode in ("graph", "eager"):
            print(f"\nms per call, {mode}" + (" (CUDA-graph replay of 20 calls)" if mode == "graph" else
                                              " (events around one Python call)"))
            print(f"{'shape':<8}{'M':>5}" + "".join(f"{k:>9}" for k in keys) + f"{'blk/bf16':>9}{'blk TB/s':>9}"
                  f"{'blk TF/s':>9}{'blk err':>9}{'cub err':>9}{'smm err':>9}{'sk err':>9}")
            for r in rows:
                cells = "".join(f"{r[f'{k}_{mode}_ms']:>9.4f}" if f"{k}_{mode}_ms" in r else f"{'-':>9}" for k in keys)
                print(f"{r['shape']:<8}{r['M']:>5}{cells}{r[f'blk_{mode}_ms'] / r[f'bf16_{mode}_ms']:>9.2f}"
                      f"{r['blk_TBps']:>9.2f}{r['blk_TFLOPs']:>9.0f}{r['blk_err']:>9.1e}"
                      f"{r.get('cublas_err', float('nan')):>9.1e}{r['smm_err']:>9.1e}"
                      f"{r.get('splitk_err', float('nan')):>9.1e}")
    if sweeps:
        print("\nsweep (Triton GEMM alone, graph replay): best config (BLOCK_M, BLOCK_N, GROUP_M, warps, stages)")
        print(f"{'shape':<8}{'M':>5}{'best ms':>9}{'TB/s':>7}{'default ms':>11}  best / default")
        table: dict[tuple[int, int], dict[int, tuple]] = {}
        for s in sweeps:
            print(f"{s['shape']:<8}{s['M']:>5}{s['best_ms']:>9.4f}{s['best_TBps']:>7.2f}{s['default_ms']:>11.4f}  "
                  f"{tuple(s['best'])} / {tuple(s['default'])}")
            table.setdefault((s["N"], s["K"]), {})[s["M"]] = tuple(s["best"])
        skw = [s for s in sweeps if "splitk_best" in s]
        if skw:
            print("\nsplit-K GEMM alone (graph replay): best (BLOCK_N, splits, warps, stages, TMA, BLOCK_M; 0: M's)"
                  " vs its default, the Triton GEMM's best and cuBLAS block-wise alone")
            print(f"{'shape':<8}{'M':>5}{'best ms':>9}{'TB/s':>7}{'default ms':>11}{'plain ms':>9}{'tma ms':>8}"
                  f"{'triton ms':>10}{'cublas ms':>10}  best / default")
            for s in skw:
                print(f"{s['shape']:<8}{s['M']:>5}{s['splitk_best_ms']:>9.4f}{s['splitk_best_TBps']:>7.2f}"
                      f"{s['splitk_default_ms']:>11.4f}{s['splitk_best_plain_ms']:>9.4f}{s['splitk_best_tma_ms']:>8.4f}"
                      f"{s['best_ms']:>10.4f}"
                      f"{s.get('cublas_alone_ms', float('nan')):>10.4f}"
                      f"  {tuple(s['splitk_best'])} / {tuple(s['splitk_default'])}")
        print("\nentries for batchgen/kernels/fp8/gemm_launches.json (commit the 'triton' ones whose us beats "
              "baseline_us; device: this GPU's name):")
        device = torch.cuda.get_device_name()
        by_shape = {(s["N"], s["K"], s["M"]): s for s in sweeps}
        for (n, k), per_m in table.items():
            for m, cfg in sorted(per_m.items()):
                s = by_shape[(n, k, m)]
                print(json.dumps({"kernel": "triton", "n": n, "k": k, "max_rows": m,
                                  "config": dict(zip(GemmConfig._fields, cfg)), "us": round(1000 * s["best_ms"], 1),
                                  "baseline_us": round(1000 * s["default_ms"], 1), "baseline": "the default config",
                                  "device": device, "what": s["shape"]}) + ",")
        for (n, k), m in splitk_shape_rows(sweeps, sweep_m, fp8_gemm.SPLITK_MAX_ROWS).items():
            s = by_shape[(n, k, m)]
            print(json.dumps({"kernel": "splitk", "n": n, "k": k, "max_rows": m, "config": None,
                              "us": round(1000 * s["splitk_default_ms"], 1),
                              "baseline_us": round(1000 * s["cublas_alone_ms"], 1),
                              "baseline": "cuBLASLt block-wise _scaled_mm", "device": device,
                              "what": s["shape"]}) + ",")
    print(f"\n({time.time() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "sweep": sweeps}, f, indent=1)


if __name__ == "__main__":
    main()

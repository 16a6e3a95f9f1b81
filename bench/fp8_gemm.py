"""FP8 GEMMs on the GPU: numerics against the torch references and time against bf16, at the Llama-3.1-8B layer
shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) and M = 32, 256, 512 rows.

    python3 bench/fp8_gemm.py [--json out.json] [--sweep]

Per (shape, M): bf16 F.linear (cuBLASLt, as the decode graphs capture it); fp8 block 128x128 (the Triton kernel
with its per-token-group activation quantisation fused in); fp8 per-channel through torch._scaled_mm (+ the
per-token quantisation kernel); fp8 per-channel through the Triton kernel. Times are CUDA-event medians over
weight copies rotated to exceed the L2 cache (each call reads its weight from HBM, as a decode step does), with
the TB/s of the weight bytes. Errors: max |out - ref| / max |ref|, ref = the emulated W8A8 reference (same
quantisation in fp32) and the unquantised-activation reference (the cost of activation quantisation itself).
--sweep also times each Triton launch config (BLOCK_M, BLOCK_N, warps, stages) and reports the fastest.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from batchgen.kernels.fp8_gemm import block_scaled_matmul, rowwise_scaled_mm
from batchgen.kernels.fp8_quant import linear_ref, quantize_weight

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (32, 256, 512)
L2_BYTES = 256 << 20  # rotate weight copies over more than this (H200 L2: 50 MB)
SWEEP = [(bm, bn, w, s) for bm in (16, 32, 64) for bn in (32, 64, 128) for w in (4, 8) for s in (3, 4)]


def time_ms(fn, copies: int, iters: int = 30) -> float:
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


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def bench_shape(name: str, n: int, k: int, sweep: bool) -> list[dict]:
    g = torch.Generator("cuda").manual_seed(0)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    copies = max(2, -(-L2_BYTES // (n * k)))  # fp8 bytes per copy: n k
    block = [quantize_weight(w16, 128, 128) for _ in range(copies)]
    channel = [quantize_weight(w16, None, None) for _ in range(copies)]
    bf16 = [w16.clone() for _ in range(max(2, copies // 2))]
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        (wb, sb), (wc, sc) = block[0], channel[0]
        r = {"shape": name, "N": n, "K": k, "M": m}
        out_b = block_scaled_matmul(x, wb, sb, 128, 128)
        r["block_err_vs_w8a8_ref"] = rel_err(out_b, linear_ref(x, wb, sb, 128, 128, act_group=128))
        r["block_err_vs_dequant_ref"] = rel_err(out_b, linear_ref(x, wb, sb, 128, 128))
        out_c = rowwise_scaled_mm(x, wc, sc.view(1, -1))
        r["scaled_mm_err_vs_w8a8_ref"] = rel_err(out_c, linear_ref(x, wc, sc, 1, None, act_group=k))
        r["channel_triton_err_vs_w8a8_ref"] = rel_err(block_scaled_matmul(x, wc, sc, 1, None),
                                                      linear_ref(x, wc, sc, 1, None, act_group=128))
        r["bf16_err_vs_fp32"] = rel_err(F.linear(x, w16), x.float() @ w16.float().t())
        r["bf16_ms"] = time_ms(lambda i: F.linear(x, bf16[i % len(bf16)]), len(bf16))
        r["fp8_block_ms"] = time_ms(lambda i: block_scaled_matmul(x, *block[i], 128, 128), copies)
        r["fp8_scaled_mm_ms"] = time_ms(lambda i: rowwise_scaled_mm(x, channel[i][0], channel[i][1].view(1, -1)),
                                        copies)
        r["fp8_channel_triton_ms"] = time_ms(lambda i: block_scaled_matmul(x, *channel[i], 1, None), copies)
        for key in ("bf16", "fp8_block", "fp8_scaled_mm", "fp8_channel_triton"):
            bytes_read = n * k * (2 if key == "bf16" else 1)
            r[f"{key}_TBps"] = bytes_read / (r[f"{key}_ms"] / 1e3) / 1e12
        if sweep:
            timed = {}
            for cfg in SWEEP:
                try:
                    timed[cfg] = time_ms(lambda i: block_scaled_matmul(x, *block[i], 128, 128, config=cfg), copies, 10)
                except Exception as e:  # a config the GPU cannot hold (shared memory): skipped
                    timed[cfg] = float("inf")
                    print(f"  {name} M={m} config {cfg}: {type(e).__name__}")
            best = min(timed, key=timed.get)
            r["sweep_best_config"], r["sweep_best_ms"] = list(best), timed[best]
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    rows = [r for name, (n, k) in SHAPES.items() for r in bench_shape(name, n, k, args.sweep)]
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"{'shape':<8}{'M':>5}{'bf16 ms':>9}{'block ms':>10}{'smm ms':>9}{'chT ms':>9}"
          f"{'bf16 TB/s':>10}{'block TB/s':>11}{'blk err':>9}{'smm err':>9}")
    for r in rows:
        print(f"{r['shape']:<8}{r['M']:>5}{r['bf16_ms']:>9.4f}{r['fp8_block_ms']:>10.4f}{r['fp8_scaled_mm_ms']:>9.4f}"
              f"{r['fp8_channel_triton_ms']:>9.4f}{r['bf16_TBps']:>10.2f}{r['fp8_block_TBps']:>11.2f}"
              f"{r['block_err_vs_w8a8_ref']:>9.1e}{r['scaled_mm_err_vs_w8a8_ref']:>9.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""rope_kv's launch per step size (kernels/attention/rope_kv.py: the rotary of q and k, the K/V cache write): µs per call
of each (BLOCK_T tokens a program, num_warps) on the GPU, against the old launch (one token a program, one warp:
BLOCK_T 1) and the bytes floor, at each token count asked for (Llama-8B's heads by default).

    python3 bench/rope_kv_sweep.py --tokens 256,2048,8192 [--heads 32 --kv-heads 8 --head-dim 128]
        [--qk-norm qwen3|gemma3] [--rotate-fp32] [--kv-fp8] [--block-tokens 1,2,4 --warps 1,4] [--json F]
    python3 bench/rope_kv_sweep.py --check   # CPU, TRITON_INTERPRET=1, tiny shapes: every variant against the
                                             # reference (tests/kernels/test_kernels.py runs it)

Each call writes its tokens' keys and values to random distinct slots of a paged cache (as a packed step of
many sequences does). Every variant's q and caches must equal the old launch's bit for bit (the run stops
otherwise). Timing: a CUDA graph of several calls replayed, event-timed, the median of `--reps` replays; the
calls cycle through copies of the inputs and outputs, >= 200 MB together, so no call finds its bytes in L2 (3x
the H200's). The floor: the bytes one call must move (qkv, cos / sin, slots and norm weights read once;
q and the K/V rows written) at the device-to-device copy bandwidth measured in the same run; `x32 ms`: 32 layers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

if "--check" in sys.argv:  # before Triton is imported: its kernels are interpreted on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from batchgen.kernels.attention.reference import KV_FP8  # noqa: E402
from batchgen.kernels.attention.rope_kv import QKNorm, rope_kv, rope_kv_launch, rope_kv_ref  # noqa: E402

BLOCK_SIZE = 16  # the engine's KV block size
COLD_BYTES = 200 * 2**20  # the copies a timed graph cycles through: together at least this (3x the H200's L2)
OLD_LAUNCH = (1, 1)  # (BLOCK_T, num_warps) of the kernel before token tiles: one program per (token, head)


class Step:
    """One rope_kv call's inputs and outputs: a step of `num_tokens` tokens whose keys and values go to random
    distinct slots of a cache with twice as many slots."""

    def __init__(self, num_tokens: int, args, device: str, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter: fp32 (exact as torch)
        heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
        self.shape = (heads, kv_heads)
        self.qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(device, dtype)
        angle = torch.rand(num_tokens, head_dim // 2, generator=g) * 6.0
        table_dtype = torch.float32 if args.rotate_fp32 else dtype  # OLMo2's rotary tables stay fp32
        self.cos = torch.cat([angle.cos()] * 2, -1).to(device, table_dtype)
        self.sin = torch.cat([angle.sin()] * 2, -1).to(device, table_dtype)
        num_blocks = -(-2 * num_tokens // BLOCK_SIZE)
        self.slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:num_tokens].to(device)
        cache_dtype = KV_FP8 if args.kv_fp8 else dtype
        # each call starts from these caches' random values (a stray write shows)
        self.caches = [torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=g).to(device, cache_dtype)
                       for _ in "kv"]
        self.k, self.v = (c.clone() for c in self.caches)
        self.qk_norm = None
        if args.qk_norm != "none":  # Qwen3's rounding, or Gemma3's (1 + w)
            weights = (torch.randn(2, head_dim, generator=g) * 0.3 + (0.0 if args.qk_norm == "gemma3" else 1.0))
            self.qk_norm = QKNorm(weights.to(device, dtype), 1e-6, unit_offset=args.qk_norm == "gemma3")
        self.rotate_fp32 = args.rotate_fp32

    def run(self, launch: tuple[int, int] | None, fresh: bool = False) -> torch.Tensor:
        """q [T, H, D] from one call (launch None: the reference); fresh: the caches reset first."""
        if fresh:
            self.k.copy_(self.caches[0])
            self.v.copy_(self.caches[1])
        args = (self.qkv, self.cos, self.sin, self.slots, self.k, self.v, *self.shape, self.qk_norm)
        if launch is None:
            return rope_kv_ref(*args, rotate_fp32=self.rotate_fp32)
        return rope_kv(*args, rotate_fp32=self.rotate_fp32, block_tokens=launch[0], num_warps=launch[1])

    def outputs(self, launch: tuple[int, int] | None) -> list[torch.Tensor]:
        """q, K cache and V cache of one call into reset caches, as bytes."""
        q = self.run(launch, fresh=True)
        return [x.view(torch.uint8).clone() for x in (q, self.k, self.v)]

    def bytes_moved(self) -> int:
        """What one call must read (qkv, cos / sin, slots, norm weights) and write (q, the K/V rows)."""
        num_tokens, heads, head_dim = self.qkv.shape[0], self.shape[0], self.cos.shape[1]
        kv_row = self.shape[1] * head_dim * self.k.element_size()
        q_bytes = num_tokens * heads * head_dim * self.qkv.element_size()
        norm = 0 if self.qk_norm is None else self.qk_norm.weights.nbytes
        return (self.qkv.nbytes + self.cos.nbytes + self.sin.nbytes + self.slots.nbytes + norm + q_bytes
                + 2 * num_tokens * kv_row)


def replay_ms(fn, calls: int, reps: int) -> float:
    """Per-call device ms of `fn`: a CUDA graph of `calls` calls (after a warm-up call), the median of `reps`
    event-timed replays (after one untimed replay)."""
    from batchgen.bench.graph_timing import capture_graph, median_replay_ms

    return median_replay_ms(capture_graph(fn, calls, warmup=1), calls, reps)


def grid(args) -> list[tuple[int, int]]:
    """The (BLOCK_T, num_warps) variants: the old launch first, then the grid asked for."""
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    variants = [OLD_LAUNCH] + list(itertools.product(ints(args.block_tokens), ints(args.warps)))
    return list(dict.fromkeys(variants))


def sweep(num_tokens: int, args, bandwidth: float) -> dict:
    """One token count: every variant (the grid and rope_kv_launch's) checked against the old launch, then timed."""
    steps = [Step(num_tokens, args, "cuda", seed=0)]
    copies = max(1, -(-COLD_BYTES // steps[0].bytes_moved()))
    steps += [Step(num_tokens, args, "cuda", seed=c) for c in range(1, copies)]
    floor_us = steps[0].bytes_moved() / bandwidth * 1e6
    variants = list(dict.fromkeys(grid(args) + [rope_kv_launch(num_tokens)]))
    base = steps[0].outputs(OLD_LAUNCH)
    rows = []
    for launch in variants:
        got = steps[0].outputs(launch)
        for name, a, b in zip(("q", "k cache", "v cache"), got, base):
            if not torch.equal(a, b):
                raise SystemExit(f"{num_tokens} tokens, BLOCK_T {launch[0]} warps {launch[1]}: its {name} differs "
                                 f"from the old launch's in {int((a != b).sum())} bytes")
        calls = iter(itertools.cycle(steps))
        us = 1e3 * replay_ms(lambda: next(calls).run(launch), calls=max(4, copies), reps=args.reps)
        rows.append({"block_tokens": launch[0], "num_warps": launch[1], "us": round(us, 2),
                     "x32_ms": round(32 * us / 1e3, 3), "x_floor": round(us / floor_us, 2),
                     "default": launch == rope_kv_launch(num_tokens)})
    best = min(rows, key=lambda r: r["us"])
    return {"tokens": num_tokens, "bytes": steps[0].bytes_moved(), "floor_us": round(floor_us, 2), "copies": copies,
            "rows": rows, "winner": {k: best[k] for k in ("block_tokens", "num_warps", "us")}}


def print_sweep(s: dict) -> None:
    print(f"{s['tokens']} tokens: {s['bytes'] / 1e6:.1f} MB a call, floor {s['floor_us']} us "
          f"({s['copies']} input copies cycled)")
    print(f"    {'BLOCK_T':>7} {'warps':>5} {'us/call':>9} {'x32 ms':>8} {'x floor':>8}")
    for r in sorted(s["rows"], key=lambda r: r["us"]):
        note = ("  old launch" if (r["block_tokens"], r["num_warps"]) == OLD_LAUNCH else "") + (
            "  rope_kv_launch's" if r["default"] else "")
        print(f"    {r['block_tokens']:>7} {r['num_warps']:>5} {r['us']:>9.2f} {r['x32_ms']:>8.3f} "
              f"{r['x_floor']:>8.2f}{note}")
    old = next(r for r in s["rows"] if (r["block_tokens"], r["num_warps"]) == OLD_LAUNCH)
    w = s["winner"]
    print(f"    winner: BLOCK_T {w['block_tokens']} warps {w['num_warps']}: {w['us']} us, "
          f"{old['us'] / w['us']:.2f}x faster than the old launch", flush=True)


def check() -> None:
    """Tiny shapes on the CPU (interpreted kernels, fp32; the GPU flags do not apply), in each mode (plain, Qwen3's
    and Gemma3's q/k norms, OLMo2's fp32 rotation, an fp8 cache), at 7 tokens (BLOCK_T 4: a partial last tile; 16:
    one tile wider than the step): every BLOCK_T's q and caches equal the old launch's bit for bit, and those
    equal the reference's: exactly without a q/k norm, else within 1e-5 (the fp32 sum of squares is summed in
    another order than torch's). An fp8 cache is compared with the old launch's only (the interpreter rounds to
    fp8 unlike torch: tests/kernels/test_kernels.fp8_carry_dropped)."""
    modes = [dict(qk_norm="none"), dict(qk_norm="qwen3"), dict(qk_norm="gemma3"), dict(rotate_fp32=True),
             dict(kv_fp8=True)]
    num_tokens = 7
    for mode in modes:  # 2 query heads on 1 KV head; head_dim 24: columns 12..15 of each half masked
        args = argparse.Namespace(**{**dict(heads=2, kv_heads=1, head_dim=24, qk_norm="none", rotate_fp32=False,
                                            kv_fp8=False, block_tokens="1,4,16", warps="1"), **mode})
        step = Step(num_tokens, args, "cpu")
        base = step.outputs(OLD_LAUNCH)
        for launch in grid(args)[1:]:
            got = step.outputs(launch)
            assert all(torch.equal(a, b) for a, b in zip(got, base)), (mode, launch, "not the old launch's")
        ref = [step.run(None, fresh=True), step.k, step.v]
        got = [x.view(r.dtype).view(r.shape) for x, r in zip(base, ref)]
        tol = 0.0 if step.qk_norm is None else 1e-5
        for name, a, b in list(zip("qkv", got, ref))[:1 if args.kv_fp8 else 3]:
            torch.testing.assert_close(a, b, atol=0.0 if name == "v" else tol, rtol=0.0 if name == "v" else tol,
                                       msg=lambda m: f"{mode} {name}: {m}")
    print("ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="256,2048,8192", help="token counts of the steps")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--qk-norm", choices=("none", "qwen3", "gemma3"), default="none")
    ap.add_argument("--rotate-fp32", action="store_true", help="OLMo2's fp32 rotary tables and rotation")
    ap.add_argument("--kv-fp8", action="store_true", help="an fp8 (e4m3) K/V cache")
    ap.add_argument("--block-tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=20, help="timed graph replays a variant (the median is kept)")
    ap.add_argument("--check", action="store_true",
                    help="CPU, interpreted kernels, tiny shapes in every mode: the variants against the reference")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.check:
        return check()
    from batchgen.bench.seed import measure_ceilings

    bandwidth = measure_ceilings().copy_bytes_s  # the benches' one copy-rate measurement
    report = {"device": torch.cuda.get_device_name(), "copy_TBps": round(bandwidth / 1e12, 3),
              "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "qk_norm": args.qk_norm,
              "rotate_fp32": args.rotate_fp32, "kv_fp8": args.kv_fp8, "sweeps": []}
    print(f"{report['device']}: copy {report['copy_TBps']} TB/s; heads {args.heads} / {args.kv_heads} of "
          f"{args.head_dim}, q/k norm {args.qk_norm}, rotate_fp32 {args.rotate_fp32}, fp8 cache {args.kv_fp8}")
    for num_tokens in (int(x) for x in args.tokens.split(",")):
        report["sweeps"].append(sweep(num_tokens, args, bandwidth))
        print_sweep(report["sweeps"][-1])
        if args.json:  # after every token count: a later failure loses nothing measured
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""The paged prefill attention launch per step shape: which (block_m, block_n, num_warps, num_stages) runs a prefill
step's causal attention fastest on the GPU (kernels/attention/paged_prefill.py), against the launch used before any
sweep (BASELINE: 16 tokens an item, 64-key tiles, 4 warps, 2 stages) and the one prefill_launch picks today (the
default), and how far each is from the causal-attention FLOP floor. On the H200, 4 prompts of 2,048 tokens took
25.1 ms of attention over Llama-3.1-8B's 32 layers at the baseline launch before the kernel's unmasked tiles and
exp2, 4.6x their 5.5 ms of FLOPs; 14.2 ms after, 13.2 at the launch now chosen (2026-12-02,
bench/results/2026-12-02-prefill-kernels-fp8-job.md).

    python3 bench/prefill_attention_sweep.py --shapes 8192x68,8192x2048,2048x2048,2048x512+1536 --json sweep.json

A shape TOKENSxLEN is one step of TOKENS new tokens from prompts of LEN tokens (the last one cut short), all from
context 0; TOKENSxLEN+CACHED: chunks of LEN tokens, each after CACHED tokens already in the cache. Llama-3.1-8B's
attention by default (32 query heads on 8 KV heads of 128: --heads, --kv-heads, --head-dim), bf16, a paged cache of
the engine's KV block size with each sequence's blocks scattered at random.

Per shape, every launch of the grid (--block-m x --block-n x --warps x --stages, plus the baseline and the default)
is timed with CUDA events: --warmup calls, then the median of --reps calls, L2 flushed before each (the engine's
layers stream their weights between two attention calls). Printed: its time a layer, x --layers, its ratio to the
floor (4 x the step's causal query-key pairs x head_dim x query heads FLOPs, at the bf16 matmul rate of an 8192^3
torch.matmul timed in the same run), its output's max abs difference from the baseline's, and the shape's winner
(the fastest launch whose output is within DIFF_LIMIT of the baseline's). A launch that does not fit the GPU (shared
memory) is listed as skipped. Before timing, --compile-workers processes compile every launch into Triton's on-disk
cache (a launch compiles in seconds; the default grid holds 72). --json PATH writes every row, after every shape.

--check: nothing timed; every launch's output against the torch reference (paged_attention_ref) on the device at
hand: on CPU under TRITON_INTERPRET=1 (fp32; tiny shapes, geometry and grid by default: warps and stages change
nothing there), or on a GPU (bf16). Exits 1 if any launch is off. tests/kernels/test_prefill_launch.py runs it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchgen.engine.config import EngineConfig  # noqa: E402
from batchgen.kernels.attention.reference import paged_attention_ref  # noqa: E402
from batchgen.kernels.attention.paged_prefill import paged_prefill_attention  # noqa: E402
from batchgen.kernels.attention.prefill_launch import (PrefillLaunch, PrefillWork,  # noqa: E402
                                             prefill_launch)

BLOCK_SIZE = EngineConfig.model_fields["block_size"].default  # the engine's KV block size
DIFF_LIMIT = 0.05  # bf16: a launch whose output is further than this from the baseline's is suspect, never a winner
FLUSH_BYTES = 256 * 2**20  # written before each timed call: 5x the H200's L2
CHECK_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # --check: relative error (L2 norm) against the reference
GPU_DEFAULTS = dict(shapes="8192x68,8192x2048,2048x2048,2048x512+1536", heads=32, kv_heads=8, head_dim=128,
                    block_m="16,32,64,128", block_n="32,64,128", warps="4,8", stages="2,3,4")
CHECK_DEFAULTS = dict(shapes="48x24,40x20+28", heads=8, kv_heads=2, head_dim=32,
                      block_m="16,32,64,128", block_n="16,64", warps="4", stages="2")


@dataclass(frozen=True)
class Shape:
    """One step: `tokens` new tokens in chunks of `prompt_len` (the last one cut short), each after `cached`."""

    tokens: int
    prompt_len: int
    cached: int = 0

    @staticmethod
    def parse(text: str) -> Shape:
        """TOKENSxLEN or TOKENSxLEN+CACHED."""
        tokens, rest = text.split("x")
        prompt_len, _, cached = rest.partition("+")
        return Shape(int(tokens), int(prompt_len), int(cached or 0))

    def __str__(self) -> str:
        return f"{self.tokens}x{self.prompt_len}" + (f"+{self.cached}" if self.cached else "")

    def q_lens(self) -> list[int]:
        whole, rest = divmod(self.tokens, self.prompt_len)
        return [self.prompt_len] * whole + ([rest] if rest else [])

    def causal_pairs(self, window: int | None = None) -> int:
        """(query, key) pairs causal attention computes: each chunk's i-th token (i from 1) sees cached + i keys,
        at most `window`."""
        seen = [np.arange(self.cached + 1, self.cached + q + 1) for q in self.q_lens()]  # [q] keys each token sees
        return sum(int(np.minimum(s, window or s).sum()) for s in seen)


@dataclass(frozen=True)
class Geometry:
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    window: int | None = None
    softcap: float | None = None

    def default_launch(self, max_query_len: int) -> PrefillLaunch:
        """The launch the engine picks for a step of these heads in bf16 whose longest query is max_query_len."""
        return prefill_launch(max_query_len, self.head_dim, 2)

    def floor_ms(self, shape: Shape, flop_s: float) -> float:
        """The causal-attention FLOPs of one layer (QK^T and PV: 2 x 2 FLOPs a pair a head dim) at `flop_s`."""
        return 4 * shape.causal_pairs(self.window) * self.head_dim * self.heads / flop_s * 1e3


@dataclass
class Step:
    """A step's queries and paged K/V cache, and the kernel's work items (one list per block_m, built once)."""

    query: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, W] int32
    q_lens: np.ndarray  # [S]
    geometry: Geometry
    items: dict[int, torch.Tensor] = field(default_factory=dict)  # block_m -> [P, 2] int32

    @staticmethod
    def build(shape: Shape, geometry: Geometry, dtype: torch.dtype, device: str, seed: int = 0) -> Step:
        g = torch.Generator().manual_seed(seed)
        q_lens = np.array(shape.q_lens())
        seq_lens = q_lens + shape.cached
        blocks_per_seq = -(-int(seq_lens.max()) // BLOCK_SIZE)
        num_blocks = len(q_lens) * blocks_per_seq
        cache_shape = (num_blocks, BLOCK_SIZE, geometry.kv_heads, geometry.head_dim)
        k_cache = torch.randn(cache_shape, generator=g).to(device, dtype)
        v_cache = torch.randn(cache_shape, generator=g).to(device, dtype)
        tables = torch.randperm(num_blocks, generator=g).view(len(q_lens), blocks_per_seq)  # blocks scattered
        query = torch.randn(shape.tokens, geometry.heads, geometry.head_dim, generator=g).to(device, dtype)
        qsl = np.concatenate([[0], np.cumsum(q_lens)])
        as_int32 = lambda a: torch.as_tensor(a, dtype=torch.int32).to(device)  # noqa: E731
        return Step(query, k_cache, v_cache, as_int32(qsl), as_int32(seq_lens), as_int32(tables), q_lens, geometry)

    def attend(self, launch: PrefillLaunch) -> torch.Tensor:
        if launch.block_m not in self.items:
            qsl = np.concatenate([[0], np.cumsum(self.q_lens)])
            self.items[launch.block_m] = PrefillWork.build(self.q_lens, qsl, launch, self.query.device).items
        work = PrefillWork(self.items[launch.block_m], launch)
        return paged_prefill_attention(self.query, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens,
                                       self.block_tables, work, self.geometry.head_dim ** -0.5,
                                       sliding_window=self.geometry.window, softcap=self.geometry.softcap)

    def reference(self) -> torch.Tensor:
        """paged_attention_ref in fp64 on CPU, fp32 on a GPU. [T, H, D]"""
        wide = torch.float64 if self.query.device.type == "cpu" else torch.float32
        return paged_attention_ref(self.query.to(wide), self.k_cache.to(wide), self.v_cache.to(wide),
                                   self.query_start_loc, self.seq_lens, self.block_tables, int(self.q_lens.max()),
                                   int(self.seq_lens.max()), self.geometry.head_dim ** -0.5,
                                   sliding_window=self.geometry.window, softcap=self.geometry.softcap)


BASELINE = PrefillLaunch(block_m=16, block_n=64, num_warps=4, num_stages=2)  # every step's launch before 2026-12-02


def grid(block_ms: list[int], block_ns: list[int], warps: list[int], stages: list[int]) -> list[PrefillLaunch]:
    return [PrefillLaunch(*p) for p in itertools.product(block_ms, block_ns, warps, stages)]


def candidates(launches: list[PrefillLaunch], default: PrefillLaunch) -> list[PrefillLaunch]:
    """The baseline first, the default second, then the grid's other launches (each once)."""
    return list(dict.fromkeys([BASELINE, default, *launches]))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.to(ref.dtype) - ref).norm() / ref.norm())


def check_shape(shape: Shape, geometry: Geometry, launches: list[PrefillLaunch], dtype: torch.dtype,
                device: str) -> list[dict]:
    """One row per launch: its relative error against the reference, and whether it is within CHECK_TOL."""
    step = Step.build(shape, geometry, dtype, device)
    ref = step.reference()
    rows = []
    for launch in candidates(launches, geometry.default_launch(int(step.q_lens.max()))):
        err = relative_error(step.attend(launch), ref)
        rows.append({"shape": str(shape), **asdict(launch), "rel_err": err, "ok": err < CHECK_TOL[dtype]})
    return rows


def timed_ms(fn, warmup: int, reps: int, flush: torch.Tensor) -> float:
    """Median ms of `fn()` over `reps` calls (CUDA events), each after `flush` is rewritten (L2 holds none of its
    inputs), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def compile_launches(geometry: Geometry, launches: list[PrefillLaunch]) -> list[tuple[PrefillLaunch, str]]:
    """A compile worker's job: run each launch once on a small step of the geometry (the kernel is specialised on
    strides and flags alone, so its compiled binary is the one the timed shapes use) and return (launch, why) for
    each one that failed to compile or launch."""
    step = Step.build(Shape(256, 128), geometry, torch.bfloat16, "cuda")
    failed = []
    for launch in launches:
        try:
            step.attend(launch)
            torch.cuda.synchronize()
        except Exception as e:  # triton's OutOfResources (shared memory), a compile error: not a candidate
            failed.append((launch, f"{type(e).__name__}: {str(e)[:160]}"))
    return failed


def compile_all(workers: int, geometry: Geometry, launches: list[PrefillLaunch]) -> dict[PrefillLaunch, str]:
    """Every launch compiled once across `workers` processes; launch -> why it failed."""
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(compile_launches, geometry, launches[i::workers]) for i in range(workers)]
        return {launch: why for future in futures for launch, why in future.result()}


def sweep_shape(shape: Shape, geometry: Geometry, launches: list[PrefillLaunch], flop_s: float, layers: int,
                warmup: int, reps: int, failed: dict[PrefillLaunch, str]) -> dict:
    """The shape's rows (the baseline's first) and its winner."""
    from triton.runtime.errors import OutOfResources

    step = Step.build(shape, geometry, torch.bfloat16, "cuda")
    max_query_len = int(step.q_lens.max())
    floor_ms = geometry.floor_ms(shape, flop_s)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    baseline_out = step.attend(BASELINE)
    rows = []
    default = geometry.default_launch(max_query_len)
    for launch in candidates(launches, default):
        row = {**asdict(launch), "baseline": launch == BASELINE, "default": launch == default}
        if launch in failed:
            rows.append({**row, "skipped": failed[launch]})
            continue
        try:
            diff = float((step.attend(launch).float() - baseline_out.float()).abs().max())
            ms = timed_ms(lambda: step.attend(launch), warmup, reps, flush)
        except OutOfResources as e:  # too large a tile for shared memory (not compiled by a worker)
            rows.append({**row, "skipped": f"OutOfResources: {e}"})
            continue
        rows.append({**row, "ms": ms, "ms_all_layers": ms * layers, "x_floor": ms / floor_ms, "max_abs_diff": diff})
    timed = [r for r in rows if "ms" in r and r["max_abs_diff"] <= DIFF_LIMIT]
    return {"shape": str(shape), "num_seqs": len(step.q_lens), "max_query_len": max_query_len,
            "causal_pairs": shape.causal_pairs(geometry.window), "floor_ms": floor_ms,
            "floor_ms_all_layers": floor_ms * layers,
            "baseline_rel_err": relative_error(baseline_out, step.reference()),
            "rows": rows, "winner": min(timed, key=lambda r: r["ms"]) if timed else None}


def launch_name(r: dict) -> str:
    return f"{r['block_m']}/{r['block_n']}/{r['num_warps']}/{r['num_stages']}"


def print_shape(result: dict, layers: int, top: int = 12) -> None:
    print(f"{result['shape']}: {result['num_seqs']} sequences, longest query {result['max_query_len']}; floor "
          f"{result['floor_ms']:.3f} ms a layer ({result['floor_ms_all_layers']:.2f} ms x{layers}); baseline's "
          f"relative error against the reference {result['baseline_rel_err']:.1e}")
    print(f"    {'block_m/block_n/warps/stages':30} {'ms/layer':>9} {'ms x' + str(layers):>9} {'x floor':>8} "
          f"{'max|diff|':>10}")
    timed = sorted((r for r in result["rows"] if "ms" in r), key=lambda r: r["ms"])
    shown = [r for i, r in enumerate(timed) if i < top or r["baseline"] or r["default"]]
    for r in shown:
        tags = " ".join(t for t in ("baseline", "default") if r[t])
        flag = "  OFF" if r["max_abs_diff"] > DIFF_LIMIT else ""
        print(f"    {launch_name(r):30} {r['ms']:9.3f} {r['ms_all_layers']:9.2f} {r['x_floor']:8.2f} "
              f"{r['max_abs_diff']:10.2e}  {tags}{flag}")
    for r in result["rows"]:
        if "skipped" in r:
            print(f"    {launch_name(r):30} skipped: {r['skipped']}")
    w, base = result["winner"], result["rows"][0]
    if w is not None and "ms" in base:
        print(f"    winner {launch_name(w)}: {w['ms']:.3f} ms a layer ({w['ms_all_layers']:.2f} ms x{layers}, "
              f"{w['x_floor']:.2f}x the floor), {base['ms'] / w['ms']:.2f}x faster than the baseline", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", help=f"TOKENSxLEN[+CACHED], comma-separated (default {GPU_DEFAULTS['shapes']})")
    ap.add_argument("--heads", type=int, help="query heads (default 32)")
    ap.add_argument("--kv-heads", type=int, help="KV heads (default 8)")
    ap.add_argument("--head-dim", type=int, help="default 128")
    ap.add_argument("--window", type=int, help="sliding window (default none)")
    ap.add_argument("--softcap", type=float, help="logit soft-cap (default none)")
    ap.add_argument("--block-m", help=f"comma-separated (default {GPU_DEFAULTS['block_m']})")
    ap.add_argument("--block-n", help=f"comma-separated (default {GPU_DEFAULTS['block_n']})")
    ap.add_argument("--warps", help=f"comma-separated (default {GPU_DEFAULTS['warps']})")
    ap.add_argument("--stages", help=f"comma-separated (default {GPU_DEFAULTS['stages']})")
    ap.add_argument("--layers", type=int, default=32, help="the model's layers (the x-layers column)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--compile-workers", type=int, default=12, help="0 or 1: each launch compiles as it is timed")
    ap.add_argument("--check", action="store_true", help="each launch against the reference, nothing timed")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    for key, value in (CHECK_DEFAULTS if args.check else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    geometry = Geometry(args.heads, args.kv_heads, args.head_dim, args.window, args.softcap)
    launches = grid(ints(args.block_m), ints(args.block_n), ints(args.warps), ints(args.stages))
    shapes = [Shape.parse(s) for s in args.shapes.split(",")]
    report = {"geometry": asdict(geometry), "block_size": BLOCK_SIZE, "args": vars(args), "shapes": []}

    def save() -> None:  # after every shape: a later failure loses nothing measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    if args.check:
        device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        report["device"] = device
        bad = 0
        for shape in shapes:
            rows = check_shape(shape, geometry, launches, dtype, device)
            report["shapes"].append({"shape": str(shape), "rows": rows})
            save()
            for r in rows:
                print(f"{shape} {launch_name(r)}: relative error {r['rel_err']:.1e} {'ok' if r['ok'] else 'OFF'}")
            bad += sum(not r["ok"] for r in rows)
        print(f"{bad} launches off the reference" if bad else "every launch matches the reference: ok")
        sys.exit(1 if bad else 0)

    from batchgen.bench.seed import measure_ceilings

    flop_s = measure_ceilings().matmul_flop_s  # the benches' one matmul-rate measurement
    report.update(device=torch.cuda.get_device_name(), matmul_TFLOPs=flop_s / 1e12)
    print(f"{report['device']}: bf16 matmul {flop_s / 1e12:.0f} TFLOP/s; {geometry}; KV blocks of {BLOCK_SIZE}")
    defaults = [geometry.default_launch(max(s.q_lens())) for s in shapes]
    every = list(dict.fromkeys([BASELINE, *defaults, *launches]))
    failed = {}
    if args.compile_workers > 1:
        t0 = time.time()
        failed = compile_all(args.compile_workers, geometry, every)
        print(f"{len(every)} launches compiled by {args.compile_workers} workers in {time.time() - t0:.0f} s, "
              f"{len(failed)} failed", flush=True)
    for shape in shapes:
        result = sweep_shape(shape, geometry, launches, flop_s, args.layers, args.warmup, args.reps, failed)
        report["shapes"].append(result)
        save()
        print_shape(result, args.layers)


if __name__ == "__main__":
    main()

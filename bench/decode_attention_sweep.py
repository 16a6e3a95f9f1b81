"""The decode attention launch per model geometry: which (splits, block_n, num_warps, num_stages, ...) streams the K/V
cache fastest, for the kernel the fused decoders run (rotary + K/V write + paged decode attention in one kernel,
`paged_decode_rope_attention`), at each (sequences, context) shape asked for, against the heuristic launch
(`kernels/decode_launch.heuristic_launch`, what `default_launch` gives without a table entry).

Gemma2-9B (8 KV heads of 256) and Phi-3-mini (32 of 96) ran their decode attention at 2.05x and 1.71x their K/V bytes
on the H200 with the launch tuned for Llama's 8 x 128 (2026-12-01,
bench/results/2026-12-01-logprobs-moe-deterministic-cost.md); this measures what `default_launch` should pick per head
size and program count.

    python3 bench/decode_attention_sweep.py --geometries llama-8b,gemma2-9b,phi3-mini \\
        --shapes 32:768,256:160,256:512 --compile-workers 12 --json sweep.json \\
        [--write-table batchgen/kernels/attention/decode_launches.json]

Each launch is timed from CUDA-graph replay (bench/profile_decode.graph_ms) over random block tables (blocks
scattered as a long run leaves them; the calls cycle through copies of the cache, >= 200 MB together, so no call
reads K/V left in L2 by the one before); `kv_x` is the time over the K/V bytes at the copy bandwidth measured here.
A context LO-HI is ragged (every length from LO to HI, shuffled): a long run's decode batches look like that, and a
launch that wins at every uniform length can lose there (2026-12-02: block_n 32 / 2 warps, the fastest at uniform
contexts 160-2,048, spent 13 % more decode attention time on the mixed load than the earlier 128 / 4). Compiling a
launch takes ~1-2 s (the full grid: 42 launches a shape, 70 where few programs add 8-16 splits; 12 workers compiled
55 in 14-21 s on the H200), so before timing a shape `--compile-workers N` processes run every candidate once,
filling Triton's on-disk kernel cache, and the timing loop's compiles are cache hits (N 0 or 1: no workers; each
launch compiles as it is timed). A candidate that failed to compile or launch there (too much shared memory) is
skipped, with a note.

`--write-table PATH` merges the fastest launch of every swept shape into a launch table (PATH
batchgen/kernels/attention/decode_launches.json: the one the package ships and `default_launch` reads), keyed by the
geometry's (head_dim, num_kv_heads, group) and the shape's sequences, but only where it beat the heuristic by
>= 3 % (otherwise the heuristic stays, and an older entry of that key and sequences is dropped). A new entry is
committed together with its measured figures in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, fields, replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchgen.bench.geometries import model_config  # noqa: E402
from batchgen.kernels.attention.decode_launch import DecodeLaunch, heuristic_launch, parse_table  # noqa: E402
from batchgen.kernels.attention.reference import KV_FP8, as_cached  # noqa: E402

BLOCK_SIZE = 16  # the engine's KV block size
MIN_GAIN = 0.03  # a table entry only for a launch at least this much faster than the heuristic's
LAUNCH_FIELDS = tuple(f.name for f in fields(DecodeLaunch))
ABOUT = ("Decode attention launches measured on the GPU; kernels/decode_launch.default_launch reads them. Written by "
         "bench/decode_attention_sweep.py --write-table.")


def heads(geometry: str) -> tuple[int, int, int, float | None]:
    """(query heads, KV heads, head_dim, attention soft-cap) of a geometry's attention layers."""
    cfg = model_config(geometry).get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, getattr(cfg, "attn_logit_softcapping", None)


# (block_n, num_warps) pairs worth compiling: wider tiles want more warps, narrow ones fewer (a full product of
# 16-128 keys and 2-8 warps compiled ~140 kernels a geometry, too many for one 10-minute device command)
TENSOR_CORE_TILES = ((32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8))
CUDA_CORE_TILES = ((16, 2), (32, 2), (32, 4), (64, 4))


def launches(grid: str, programs: int) -> list[DecodeLaunch]:
    """The candidate launches. 'full': tensor-core tiles at 1-4 context splits and 2-3 stages, and 8-16 splits
    where (sequences x KV heads) `programs` < 256 would leave SMs idle (Qwen2's 4 and Starcoder2's 2 KV heads);
    'all': also the CUDA-core tiles (`mma=False`); 'small': one split or two, 2 stages."""
    if grid == "small":
        return [DecodeLaunch(sp, n, w, 2) for sp, (n, w) in itertools.product((1, 2), TENSOR_CORE_TILES)]
    splits = (1, 2, 4, 8, 16) if programs < 256 else (1, 2, 4)
    out = [DecodeLaunch(sp, n, w, st) for sp, (n, w), st in itertools.product(splits, TENSOR_CORE_TILES, (2, 3))]
    if grid == "all":
        out += [DecodeLaunch(sp, n, w, 2, False) for sp, (n, w) in itertools.product(splits, CUDA_CORE_TILES)]
    return out


@dataclass
class ShapeInputs:
    """One geometry's decode step at (sequences, context), on the GPU: what `paged_decode_rope_attention` reads."""

    qkv: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: list[torch.Tensor]  # per copy: [num_seqs] int64
    k: torch.Tensor  # [copies * blocks, BLOCK_SIZE, Hkv, D]
    v: torch.Tensor
    tables: list[torch.Tensor]  # per copy: [num_seqs, blocks_per_seq] int32 into that copy's blocks
    lens: torch.Tensor
    num_heads: int
    softcap: float | None
    calls: int = 0

    def attend(self, launch: DecodeLaunch) -> torch.Tensor:
        """One call, over the next copy's blocks (calls cycle through the copies: a timed graph of several calls
        never re-reads K/V still in L2, as the engine's layers, which stream their weights between, never do)."""
        from batchgen.kernels.attention.paged_decode import paged_decode_rope_attention

        i = self.calls % len(self.tables)
        self.calls += 1
        return paged_decode_rope_attention(self.qkv, self.cos, self.sin, self.slots[i], self.k, self.v,
                                           self.tables[i], self.lens, self.k.shape[3] ** -0.5, self.num_heads,
                                           softcap=self.softcap, launch=launch)

    def kv_bytes(self) -> int:
        return 2 * int(self.lens.sum()) * self.k.shape[2] * self.k.shape[3] * self.k.element_size()


# K/V copies a timed call cycles through: together at least this many bytes, 4x the H200's 50 MB L2 (Qwen2-7B's
# K/V at 32 x 768 is 50 MB a layer, Starcoder2-3B's 25 MB: timed over one copy, repeated calls hit L2)
COLD_BYTES = 200 * 2**20


def parse_context(text: str) -> int | str:
    """A shape's context: "768" (every sequence 768 tokens) or "32-3072" (ragged: the lengths spread evenly from
    32 to 3,072 in a fixed shuffled order, as a long mixed run's decode batch holds sequences of every age)."""
    lo, dash, hi = text.partition("-")
    if not lo.isdigit() or (dash and not hi.isdigit()) or int(lo) < 1 or (hi and int(hi) < int(lo)):
        raise ValueError(f"context {text!r} is not N or LO-HI (tokens, 1 <= LO <= HI)")
    return f"{int(lo)}-{int(hi)}" if hi else int(lo)


def parse_shape(text: str) -> tuple[int, int | str]:
    """"SEQS:CONTEXT" -> (sequences, parse_context(CONTEXT))."""
    seqs, _, context = text.partition(":")
    if not seqs.isdigit() or int(seqs) < 1:
        raise ValueError(f"shape {text!r} is not SEQS:CONTEXT (SEQS >= 1)")
    return int(seqs), parse_context(context)


def context_lengths(context: int | str, num_seqs: int) -> list[int]:
    """Each sequence's context (the new token included) for a shape's context (parse_context)."""
    if isinstance(context, int):
        return [context] * num_seqs
    lo, hi = (int(x) for x in context.split("-"))
    even = [lo + (hi - lo) * i // max(1, num_seqs - 1) for i in range(num_seqs)]
    order = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(0)).tolist()
    return [even[i] for i in order]


def context_mean(context: int | str) -> float:
    """Where a shape's context sits among others (ragged: the mean of its ends)."""
    return context if isinstance(context, int) else sum(int(x) for x in context.split("-")) / 2


def build_inputs(geometry: str, num_seqs: int, context: int | str, dev: str = "cuda", copies: int = 1,
                 kv_dtype: str = "bf16", blocks: str = "scattered") -> ShapeInputs:
    """Random bf16 inputs of the shape, K/V in an fp8 cache where kv_dtype is "fp8" (engine.kv_cache_dtype); the
    same in the compile workers and the timing process, so a launch's compiled kernel, specialised on these shapes
    and strides, is the same cache entry in both; `copies` block
    tables over disjoint blocks of one cache (same strides: the same compiled kernel). A ragged context's
    sequences each hold the blocks of the longest (their tables' unused tail is never read). `blocks`: "scattered"
    (each copy's blocks in a random order, as a long run's allocator leaves them) or "contiguous" (each sequence's
    blocks one after another, sequence after sequence: near a fresh engine's placement of its prompts, whose blocks
    come from an ascending free list; the blocks a decode adds later interleave across sequences there, and a
    ragged shape's shorter sequences leave gaps here)."""
    if blocks not in ("scattered", "contiguous"):
        raise ValueError(f"blocks {blocks!r} is not 'scattered' or 'contiguous'")
    num_heads, num_kv_heads, head_dim, softcap = heads(geometry)
    dtype = torch.bfloat16
    lengths = context_lengths(context, num_seqs)
    blocks_per_seq = -(-(max(lengths) + 1) // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    k = torch.randn(copies * num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    if kv_dtype == "fp8":
        k, v = as_cached(k, KV_FP8), as_cached(v, KV_FP8)
    lens = torch.tensor(lengths, device=dev, dtype=torch.int32)  # the new token included
    pos = lens.long() - 1
    tables, slots = [], []
    for c in range(copies):  # each copy within its own range of blocks
        order = (torch.randperm(num_blocks, device=dev, dtype=torch.int32) if blocks == "scattered"
                 else torch.arange(num_blocks, device=dev, dtype=torch.int32))
        table = (order + c * num_blocks).view(num_seqs, -1)
        tables.append(table)
        slots.append(table.gather(1, (pos // BLOCK_SIZE)[:, None]).squeeze(1).long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim, device=dev, dtype=dtype)
    angle = pos[:, None].float() * torch.rand(head_dim, device=dev)
    cos, sin = angle.cos().to(dtype).contiguous(), angle.sin().to(dtype).contiguous()
    return ShapeInputs(qkv, cos, sin, slots, k, v, tables, lens, num_heads, softcap)


def compile_launches(geometry: str, num_seqs: int, context: int | str, chunk: list[DecodeLaunch],
                     dev: str = "cuda", kv_dtype: str = "bf16") -> list[tuple]:
    """A compile worker's job: run each launch of `chunk` once (its kernels land in Triton's on-disk cache).
    Returns (launch, why) for each launch that failed to compile or launch. (dev "cpu": tests, interpreted.)"""
    inputs = build_inputs(geometry, num_seqs, context, dev, kv_dtype=kv_dtype)
    failed = []
    for launch in chunk:
        try:
            inputs.attend(launch)
            if dev == "cuda":  # an asynchronous launch error surfaces here, attributed to its launch
                torch.cuda.synchronize()
        except Exception as e:  # triton's OutOfResources (shared memory), a compile error: not a candidate
            failed.append((launch, f"{type(e).__name__}: {str(e)[:160]}"))
    del inputs
    if dev == "cuda":
        torch.cuda.empty_cache()  # the workers stay alive between shapes: give their inputs' memory back
    return failed


def compile_in_pool(pool: ProcessPoolExecutor, workers: int, geometry: str, num_seqs: int, context: int | str,
                    candidates: list[DecodeLaunch], dev: str = "cuda", kv_dtype: str = "bf16"
                    ) -> dict[DecodeLaunch, str]:
    """Every candidate compiled once across the pool's workers (round-robin chunks); launch -> why it failed."""
    chunks = [candidates[i::workers] for i in range(workers)]
    futures = [pool.submit(compile_launches, geometry, num_seqs, context, chunk, dev, kv_dtype)
               for chunk in chunks if chunk]
    return {launch: why for future in futures for launch, why in future.result()}


def sweep_shape(geometry: str, num_seqs: int, context: int | str, candidates: list[DecodeLaunch], copy_bytes_s: float,
                failed: dict[DecodeLaunch, str] | None = None, kv_dtype: str = "bf16",
                blocks: str = "scattered") -> list[dict]:
    """One row per timed launch (the heuristic's first, marked "default"), each candidate in both grid orders."""
    from triton.runtime.errors import OutOfResources

    from profile_decode import graph_ms

    num_heads, num_kv_heads, head_dim, _ = heads(geometry)
    element_bytes = 1 if kv_dtype == "fp8" else 2
    # the K and V bytes a call reads
    one_copy = 2 * sum(context_lengths(context, num_seqs)) * num_kv_heads * head_dim * element_bytes
    inputs = build_inputs(geometry, num_seqs, context, copies=max(1, -(-COLD_BYTES // one_copy)), kv_dtype=kv_dtype,
                          blocks=blocks)
    floor_us = inputs.kv_bytes() / copy_bytes_s * 1e6

    def timed(launch: DecodeLaunch) -> float:
        return 1e3 * graph_ms(lambda: inputs.attend(launch))

    base = {"geometry": geometry, "head_dim": head_dim, "num_kv_heads": num_kv_heads,
            "group": num_heads // num_kv_heads, "num_seqs": num_seqs, "context": context, "kv_dtype": kv_dtype,
            "blocks": blocks, "floor_us": round(floor_us, 1)}
    default = heuristic_launch(num_seqs, num_kv_heads, head_dim, kv_element_bytes=element_bytes)
    # a shape's first timing runs 5-12 % slow (the H100, 2026-12-05: the heuristic's launch timed first, then again
    # as a candidate), which flattered every candidate against the heuristic: that timing is discarded
    timed(default)
    default_us = timed(default)
    rows = [{**base, **asdict(default), "default": True, "us": round(default_us, 1),
             "kv_x": round(default_us / floor_us, 2)}]
    for launch in candidates:
        if launch in (failed or {}):
            print(f"    skipped {launch}: {failed[launch]}", flush=True)
            continue
        for heads_first in (False, True):  # a runtime flag
            launch = replace(launch, heads_first=heads_first)
            try:
                us = timed(launch)
            except OutOfResources:  # a tile too large for shared memory (not compiled by workers): not a candidate
                break
            rows.append({**base, **asdict(launch), "us": round(us, 1), "kv_x": round(us / floor_us, 2)})
    return rows


def launch_of(row: dict) -> DecodeLaunch:
    return DecodeLaunch(**{f: row[f] for f in LAUNCH_FIELDS})


def across_contexts(rows: list[dict]) -> list[dict]:
    """Per (geometry, sequences) swept at several contexts: each launch timed at all of them, ranked by its worst
    time over the fastest at a context (a CUDA graph is captured per batch bucket, so one launch serves every
    context the bucket meets). Returns one dict per group: its contexts, the ranking [(launch, worst ratio, ratio
    per context)], and the heuristic's place in it."""
    groups: dict[tuple, dict[int, dict[DecodeLaunch, float]]] = {}
    defaults: dict[tuple, DecodeLaunch] = {}
    for r in rows:
        key = (r["geometry"], r["num_seqs"])
        per_launch = groups.setdefault(key, {}).setdefault(r["context"], {})
        launch = launch_of(r)
        per_launch[launch] = min(r["us"], per_launch.get(launch, float("inf")))
        if r.get("default"):
            defaults[key] = launch
    out = []
    for (geometry, num_seqs), by_context in groups.items():
        if len(by_context) < 2:
            continue
        contexts = sorted(by_context, key=context_mean)
        best = {c: min(by_context[c].values()) for c in contexts}
        common = set.intersection(*(set(by_context[c]) for c in contexts))
        ranking = sorted(((launch, max(ratios), ratios) for launch in common
                          for ratios in [[by_context[c][launch] / best[c] for c in contexts]]),
                         key=lambda t: (t[1], sum(t[2])))
        heuristic = defaults.get((geometry, num_seqs))
        place = next((i for i, (launch, _, _) in enumerate(ranking) if launch == heuristic), None)
        out.append({"geometry": geometry, "num_seqs": num_seqs, "contexts": contexts, "ranking": ranking,
                    "heuristic": heuristic, "heuristic_place": place})
    return out


def merge_table(entries: list[dict], rows: list[dict], device: str, min_gain: float = MIN_GAIN
                ) -> tuple[list[dict], list[str]]:
    """A launch table's entries with the sweep's `rows` merged in, and a note per swept shape (pure). Per shape
    (head_dim, num_kv_heads, group, num_seqs, context; ragged contexts are skipped): if its fastest row beats its
    "default" (heuristic) row by >= min_gain, that launch becomes the entry of (head_dim, num_kv_heads, group,
    num_seqs), replacing an older one; otherwise that older entry, if any, is dropped (the heuristic stays). Other
    entries are kept; the result is sorted by its key. Rows over an fp8 cache or contiguous blocks: ValueError."""
    def key(d: dict) -> tuple:
        return d["head_dim"], d["num_kv_heads"], d["group"], d["num_seqs"]

    unlike = [r for r in rows if r.get("kv_dtype", "bf16") != "bf16" or r.get("blocks", "scattered") != "scattered"]
    if unlike:  # a report's rows (--from-report) from a sweep over another cache type or block placement
        raise ValueError(f"the launch table is measured over bf16 caches and scattered blocks; {len(unlike)} rows are "
                         f"not (e.g. kv_dtype {unlike[0].get('kv_dtype', 'bf16')}, blocks "
                         f"{unlike[0].get('blocks', 'scattered')})")
    shapes: dict[tuple, list[dict]] = {}
    for r in rows:
        shapes.setdefault((*key(r), r["context"]), []).append(r)
    out, notes = list(entries), []
    for (*k, context), shape_rows in shapes.items():
        k = tuple(k)
        if isinstance(context, str):  # a table entry is keyed by one context; a ragged shape only ranks launches
            notes.append(f"{shape_rows[0].get('geometry', '?')} {k[3]} seqs x {context}: ragged, not a table entry")
            continue
        defaults = [r for r in shape_rows if r.get("default")]
        if len(defaults) != 1:
            raise ValueError(f"shape {k} x {context}: {len(defaults)} default rows, not 1")
        default, best = defaults[0], min(shape_rows, key=lambda r: r["us"])
        old = [e for e in out if key(e) == k]
        out = [e for e in out if key(e) != k]
        name = (f"{shape_rows[0].get('geometry', '?')} (head_dim, kv heads, group) {k[:3]} {k[3]} seqs x {context}:"
                f" best {best['us']} us, heuristic {default['us']} us")
        if best["us"] > default["us"] * (1 - min_gain):
            notes.append(f"{name}: under {min_gain:.0%} faster, the heuristic stays"
                         + (f" (its entry at context {old[0]['context']} dropped)" if old else ""))
            continue
        out.append({"head_dim": k[0], "num_kv_heads": k[1], "group": k[2], "num_seqs": k[3], "context": context,
                    "launch": {f: best[f] for f in LAUNCH_FIELDS}, "us": best["us"], "default_us": default["us"],
                    "device": device})
        notes.append(f"{name}: entry written"
                     + (f" (replaces its entry at context {old[0]['context']})" if old else ""))
    return sorted(out, key=key), notes


def read_table(path: str) -> dict:
    """A launch table file's contents, validated ({"about", "entries": []} if there is none yet)."""
    if not os.path.exists(path):
        return {"about": ABOUT, "entries": []}
    with open(path) as f:
        data = json.load(f)
    parse_table(data, path)
    return data


def write_table(path: str, data: dict) -> None:
    parse_table(data, path)  # what default_launch will accept: checked before the file changes
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def table_from_report(report_path: str, table_path: str) -> None:
    """Merge a saved sweep report's rows into a launch table, as the sweep would have after measuring them. Rows
    from reports written before rows carried their head geometry get it from their `geometry`; the device is the
    report's (reports without one are refused: an entry must say where it was measured)."""
    with open(report_path) as f:
        report = json.load(f)
    if "device" not in report:
        raise SystemExit(f"{report_path}: no 'device' (the GPU the rows were measured on): add it to the report")
    rows = []
    for r in report["rows"]:
        num_heads, num_kv_heads, head_dim, _ = heads(r["geometry"])
        rows.append({"head_dim": head_dim, "num_kv_heads": num_kv_heads, "group": num_heads // num_kv_heads, **r})
    table = read_table(table_path)
    table["entries"], notes = merge_table(table["entries"], rows, report["device"])
    write_table(table_path, table)
    print("\n".join(f"table: {n}" for n in notes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometries", default="llama-8b,gemma2-9b,phi3-mini")
    ap.add_argument("--shapes", default="32:768,256:160,256:512",
                    help="sequences:context pairs; a context LO-HI is ragged (parse_context)")
    ap.add_argument("--grid", choices=("full", "all", "small"), default="full")
    ap.add_argument("--compile-workers", type=int, default=8,
                    help="processes compiling the candidates into Triton's cache before timing (0 or 1: none)")
    ap.add_argument("--write-table", metavar="PATH",
                    help="merge the fastest launches into this launch table (batchgen/kernels/attention/decode_launches.json)")
    ap.add_argument("--from-report", metavar="JSON",
                    help="measure nothing: merge a saved report's (--json) rows into --write-table")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                    help="the K/V cache's type (fp8: engine.kv_cache_dtype fp8; its floor counts a byte a value)")
    ap.add_argument("--blocks", choices=("scattered", "contiguous"), default="scattered",
                    help="the K/V blocks' order in the cache: as a long run leaves them, or as a fresh engine hands "
                         "them out (sequence after sequence)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.write_table and args.kv_dtype != "bf16":
        ap.error("--write-table: the launch table is measured over bf16 caches (leave --kv-dtype at bf16)")
    if args.write_table and args.blocks != "scattered":
        ap.error("--write-table: the launch table is measured over scattered blocks (leave --blocks at scattered)")
    if args.from_report:
        if not args.write_table:
            ap.error("--from-report needs --write-table")
        return table_from_report(args.from_report, args.write_table)
    try:  # every shape checked before anything is measured
        shapes = [parse_shape(shape) for shape in args.shapes.split(",")]
    except ValueError as e:
        ap.error(f"--shapes: {e}")
    from batchgen.bench.seed import measure_ceilings

    copy_bytes_s = measure_ceilings().copy_bytes_s
    report = {"copy_TBps": copy_bytes_s / 1e12, "device": torch.cuda.get_device_name(), "rows": []}
    table = read_table(args.write_table) if args.write_table else None
    workers = args.compile_workers if args.compile_workers > 1 else 0
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) if workers else None
    for geometry in args.geometries.split(","):
        for num_seqs, context in shapes:
            num_heads, num_kv_heads, head_dim, _ = heads(geometry)
            candidates = launches(args.grid, num_seqs * num_kv_heads)
            failed = {}
            if pool:
                t0 = time.time()
                failed = compile_in_pool(pool, workers, geometry, num_seqs, context,
                                         [heuristic_launch(num_seqs, num_kv_heads, head_dim,
                                                           kv_element_bytes=1 if args.kv_dtype == "fp8" else 2),
                                          *candidates],
                                         kv_dtype=args.kv_dtype)
                print(f"{geometry} {num_seqs} seqs x {context}: {len(candidates) + 1} launches compiled by {workers} "
                      f"workers in {time.time() - t0:.0f} s, {len(failed)} failed", flush=True)
            rows = sweep_shape(geometry, num_seqs, context, candidates, copy_bytes_s, failed, args.kv_dtype,
                               args.blocks)
            report["rows"] += rows
            best = sorted(rows, key=lambda r: r["us"])
            print(f"{geometry} {num_seqs} seqs x {context} ({args.kv_dtype} K/V): floor {rows[0]['floor_us']} us; "
                  f"heuristic {rows[0]['us']} us ({rows[0]['kv_x']}x, {rows[0]['num_splits']}/{rows[0]['block_n']}/"
                  f"{rows[0]['num_warps']}/{rows[0]['num_stages']}); best:", flush=True)
            for r in best[:5]:
                print(f"    splits {r['num_splits']} block_n {r['block_n']} warps {r['num_warps']} stages "
                      f"{r['num_stages']} mma {r['mma']} heads_first {r['heads_first']}: "
                      f"{r['us']} us ({r['kv_x']}x)", flush=True)
            if args.json:  # after every shape: a later failure loses nothing measured
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)
            if table is not None:  # also after every shape (merging shape by shape = merging all rows at the end)
                table["entries"], notes = merge_table(table["entries"], rows, torch.cuda.get_device_name())
                write_table(args.write_table, table)
                print("\n".join(f"    table: {n}" for n in notes), flush=True)
    if pool:
        pool.shutdown()
    for group in across_contexts(report["rows"]):
        print(f"{group['geometry']} {group['num_seqs']} seqs, one launch for contexts {group['contexts']} (worst time "
              f"over a context's fastest; the heuristic's place {group['heuristic_place']}):")
        for launch, worst, ratios in group["ranking"][:5]:
            print(f"    {launch}: worst {worst:.3f}, per context {[round(x, 3) for x in ratios]}")


if __name__ == "__main__":
    main()

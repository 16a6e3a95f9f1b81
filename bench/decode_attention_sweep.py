"""The decode attention launch per model geometry: which (splits, block_n, num_warps, num_stages) streams the K/V
cache fastest, for the kernel the fused decoders run (rotary + K/V write + paged decode attention in one kernel,
`paged_decode_rope_attention`), at each (sequences, context) shape asked for, against `default_launch`.

Gemma2-9B (8 KV heads of 256) and Phi-3-mini (32 of 96) ran their decode attention at 2.05x and 1.71x their K/V
bytes on the H200 with the launch tuned for Llama's 8 x 128 (bench/RESULTS.md, session 9); this measures what
`paged_decode.default_launch` should pick per head size and program count.

    python3 bench/decode_attention_sweep.py --geometries llama-8b,gemma2-9b,phi3-mini \\
        --shapes 32:768,256:160,256:512 --json sweep.json

Each launch is timed from CUDA-graph replay (bench/profile_decode.graph_ms) over a random block table (blocks
scattered as a long run leaves them); `kv_x` is the time over the K/V bytes at the copy bandwidth measured here.
Every launch compiles once per geometry (~1-2 s each; the full grid's 54 launches, 72 for MHA
geometries): ~3 minutes a geometry.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchgen.bench.geometries import model_config  # noqa: E402
from batchgen.bench.seed import measure_ceilings  # noqa: E402
from batchgen.kernels.paged_decode import DecodeLaunch, default_launch, paged_decode_rope_attention  # noqa: E402
from profile_decode import graph_ms  # noqa: E402

BLOCK_SIZE = 16  # the engine's KV block size


def heads(geometry: str) -> tuple[int, int, int, float | None]:
    """(query heads, KV heads, head_dim, attention soft-cap) of a geometry's attention layers."""
    cfg = model_config(geometry).get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, getattr(cfg, "attn_logit_softcapping", None)


# (block_n, num_warps) pairs worth compiling: wider tiles want more warps, narrow ones fewer (a full product of
# 16-128 keys and 2-8 warps compiled ~140 kernels a geometry, too many for one 10-minute device command)
TENSOR_CORE_TILES = ((32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8))
CUDA_CORE_TILES = ((16, 2), (32, 2), (32, 4), (64, 4))
HEAD_BLOCK_TILES = ((16, 2), (16, 4), (32, 4))


def launches(grid: str, mha: bool) -> list[DecodeLaunch]:
    """The candidate launches: 'full' (splits 1-4; tensor-core tiles at 2-3 stages, CUDA-core tiles (`mma=False`)
    at 2; for MHA geometries, 2 or 4 KV heads a program) or 'small' (one split or two, 2 stages)."""
    splits, stages = ((1, 2), (2,)) if grid == "small" else ((1, 2, 4), (2, 3))
    out = [DecodeLaunch(sp, n, w, st) for sp, (n, w), st in itertools.product(splits, TENSOR_CORE_TILES, stages)]
    out += [DecodeLaunch(sp, n, w, 2, False) for sp, (n, w) in itertools.product(splits, CUDA_CORE_TILES)]
    if mha:
        out += [DecodeLaunch(sp, n, w, 2, mma=False, heads_per_program=hb)  # CUDA cores
                for sp, (n, w), hb in itertools.product(splits, HEAD_BLOCK_TILES, (2, 4))]
    return out


def sweep_shape(geometry: str, num_seqs: int, context: int, candidates: list[DecodeLaunch],
                copy_bytes_s: float) -> list[dict]:
    from triton.runtime.errors import OutOfResources

    num_heads, num_kv_heads, head_dim, softcap = heads(geometry)
    dev, dtype = "cuda", torch.bfloat16
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    k = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    table = torch.randperm(num_blocks, device=dev, dtype=torch.int32).view(num_seqs, blocks_per_seq)
    lens = torch.full((num_seqs,), context, device=dev, dtype=torch.int32)  # the new token included
    pos = lens.long() - 1
    slots = table.gather(1, (pos // BLOCK_SIZE)[:, None]).squeeze(1).long() * BLOCK_SIZE + pos % BLOCK_SIZE
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim, device=dev, dtype=dtype)
    angle = pos[:, None].float() * torch.rand(head_dim, device=dev)
    cos, sin = angle.cos().to(dtype).contiguous(), angle.sin().to(dtype).contiguous()
    kv_bytes = 2 * num_seqs * context * num_kv_heads * head_dim * k.element_size()
    floor_us = kv_bytes / copy_bytes_s * 1e6

    def timed(launch: DecodeLaunch | None) -> float:
        return 1e3 * graph_ms(lambda: paged_decode_rope_attention(
            qkv, cos, sin, slots, k, v, table, lens, head_dim ** -0.5, num_heads, softcap=softcap, launch=launch))

    base = {"geometry": geometry, "num_seqs": num_seqs, "context": context, "floor_us": round(floor_us, 1)}
    default = default_launch(num_seqs, num_kv_heads, head_dim)
    default_us = timed(None)
    rows = [{**base, **default.__dict__, "default": True, "us": round(default_us, 1),
             "kv_x": round(default_us / floor_us, 2)}]
    for launch in candidates:
        for heads_first in (False, True) if launch.heads_per_program == 1 else (False,):  # a runtime flag
            launch = replace(launch, heads_first=heads_first)
            try:
                us = timed(launch)
            except OutOfResources:  # a tile too large for shared memory: not a candidate
                break
            rows.append({**base, **launch.__dict__, "us": round(us, 1), "kv_x": round(us / floor_us, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometries", default="llama-8b,gemma2-9b,phi3-mini")
    ap.add_argument("--shapes", default="32:768,256:160,256:512", help="sequences:context pairs")
    ap.add_argument("--grid", choices=("full", "small"), default="full")
    ap.add_argument("--json")
    args = ap.parse_args()
    copy_bytes_s = measure_ceilings().copy_bytes_s
    report = {"copy_TBps": copy_bytes_s / 1e12, "rows": []}
    for geometry in args.geometries.split(","):
        for shape in args.shapes.split(","):
            num_seqs, context = (int(x) for x in shape.split(":"))
            num_heads, num_kv_heads = heads(geometry)[:2]
            candidates = launches(args.grid, mha=num_heads == num_kv_heads)
            rows = sweep_shape(geometry, num_seqs, context, candidates, copy_bytes_s)
            report["rows"] += rows
            best = sorted(rows, key=lambda r: r["us"])
            print(f"{geometry} {num_seqs} seqs x {context}: floor {rows[0]['floor_us']} us; default "
                  f"{rows[0]['us']} us ({rows[0]['kv_x']}x, {rows[0]['num_splits']}/{rows[0]['block_n']}/"
                  f"{rows[0]['num_warps']}/{rows[0]['num_stages']}); best:", flush=True)
            for r in best[:5]:
                print(f"    splits {r['num_splits']} block_n {r['block_n']} warps {r['num_warps']} stages "
                      f"{r['num_stages']} mma {r['mma']} heads_first {r['heads_first']} heads/program "
                      f"{r['heads_per_program']}: {r['us']} us "
                      f"({r['kv_x']}x)", flush=True)
            if args.json:  # after every shape: a later failure loses nothing measured
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

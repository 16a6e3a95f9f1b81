"""The sampling kernel alone at the job workload's shape (one GPU): µs per call for a grid of launch settings
(vocabulary block, search pivots, warps), and optionally another version of the kernel (`--previous FILE`, a
copy of an older batchgen/kernels/sample/draw.py) on the same logits, with the share of rows on which they agree.

    python3 bench/sample_kernel_sweep.py --rows 256,512 --vocab 49152,128256 [--previous F] [--json F]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchgen.kernels.sample.draw import sample_rows  # noqa: E402

GRID = [(2048, 16, 16), (1024, 16, 8), (4096, 16, 16), (4096, 16, 32), (2048, 16, 32)]


def event_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,512")
    ap.add_argument("--vocab", default="49152,128256")
    ap.add_argument("--previous")
    ap.add_argument("--json")
    args = ap.parse_args()
    previous = None
    if args.previous:
        spec = importlib.util.spec_from_file_location("sample_previous", args.previous)
        previous = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(previous)
    results = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            g = torch.Generator(device="cuda").manual_seed(0)
            # logits of a trained model are peaked: a few large ones over a broad tail
            logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 2).to(torch.bfloat16)
            st = dict(temperature=torch.full((rows,), 0.7, device="cuda"),
                      top_k=torch.full((rows,), vocab, device="cuda", dtype=torch.int64),
                      top_p=torch.full((rows,), 0.9, device="cuda"), min_p=torch.zeros(rows, device="cuda"),
                      noise_key=torch.randint(0, 1 << 32, (rows,), device="cuda", generator=g))
            ref = sample_rows(logits, *st.values())
            if previous is not None:
                old = previous.sample_rows(logits, *st.values())
                us = event_us(lambda: previous.sample_rows(logits, *st.values()))
                r = {"vocab": vocab, "rows": rows, "kernel": "previous", "us": round(us, 1),
                     "agree": round((old == ref).float().mean().item(), 4)}
                results.append(r)
                print(json.dumps(r), flush=True)
            for block, pivots, warps in GRID:
                try:
                    out = sample_rows(logits, *st.values(), block=block, pivots=pivots, num_warps=warps)
                    us = event_us(lambda: sample_rows(logits, *st.values(), block=block, pivots=pivots,
                                                      num_warps=warps))
                except Exception as e:  # a launch the GPU cannot take (registers, shared memory)
                    r = {"vocab": vocab, "rows": rows, "block": block, "pivots": pivots, "warps": warps,
                         "error": str(e)[:120]}
                else:
                    r = {"vocab": vocab, "rows": rows, "block": block, "pivots": pivots, "warps": warps,
                         "us": round(us, 1), "agree": round((out == ref).float().mean().item(), 4)}
                results.append(r)
                print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

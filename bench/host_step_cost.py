"""Host (CPU) cost of one decode step at scale: the scheduler (schedule + update) and the runner's input
preparation (step arrays, sampling tensors, staging), per step and per sequence, without the forward pass.

This is what bounds throughput when the GPU step is shorter than the host's: small models at many sequences
(with the async pipeline the two overlap, so the longer one sets the pace). Runs on CPU with a one-layer
tiny model; the forward time is measured too but is not the point.

    .venv/bin/python bench/host_step_cost.py --seqs 256 --context 512 2048 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # conftest: tiny random models

from conftest import make_model  # noqa: E402

from batchgen import Engine, EngineConfig, SamplingParams  # noqa: E402


def measure(num_seqs: int, context: int, steps: int, params: SamplingParams) -> dict:
    model = make_model("llama", num_layers=1, max_position_embeddings=context + steps + 64)
    blocks = num_seqs * (-(-(context + steps + 16) // 16))
    engine = Engine(model, None, EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=65536,
                                              num_kv_blocks=blocks))
    g = torch.Generator().manual_seed(0)
    for _ in range(num_seqs):
        engine.add_request(torch.randint(3, 500, (context,), generator=g).tolist(), params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()  # prefill
    before, t0 = engine.stats(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    after = engine.stats()
    schedule_ms = (after["schedule_cpu_s"] - before["schedule_cpu_s"]) / steps * 1e3
    prepare_ms = (after["prepare_cpu_s"] - before["prepare_cpu_s"]) / steps * 1e3
    return {"seqs": num_seqs, "context": context, "schedule_ms": round(schedule_ms, 2),
            "prepare_ms": round(prepare_ms, 2), "host_us_per_seq": round((schedule_ms + prepare_ms) * 1e3 / num_seqs, 1),
            "step_wall_ms": round(wall / steps * 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for sampling in ("greedy", "penalty"):
        params = SamplingParams(max_new_tokens=args.steps + 8, temperature=0.0, ignore_eos=True,
                                repetition_penalty=1.1 if sampling == "penalty" else 1.0)
        for context in args.context:
            rows.append({"sampling": sampling, **measure(args.seqs, context, args.steps, params)})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

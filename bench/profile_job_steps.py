"""Where the job workload's engine steps go, window by window (one GPU): per-kernel GPU time, wall time per
step and tokens per step for a few windows of steps of one engine fed like `batchgen bench --workload job`
(8B geometry, random bf16 weights, a real tokenizer's vocabulary and chat template, temperature 0.7, top_p 0.9,
256 new tokens, twice `--seqs` prompts queued so that the first wave's end and the refill fall in the run).

    python3 bench/profile_job_steps.py --tokenizer DIR --seqs 256 --windows 20:40,200:220,250:290 [--json F]

Windows are [first, last) engine step indices. Each prints: wall ms/step, generated tokens/step, GPU kernel ms
per step by kind (GEMM, attention, sampling, other), and the kernels that take the most time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchgen.bench.job import STYLES, TOPICS, WORDS, kernel_kinds  # noqa: E402
from batchgen.bench.geometries import LLAMA_8B  # noqa: E402


def build(tok_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = dict(LLAMA_8B, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.bfloat16).eval()
    return model, tok


def prompts(tok, n: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        text = f"Write a {rng.choice(STYLES)} about {rng.choice(TOPICS)}. " + " ".join(
            rng.choice(WORDS) for _ in range(rng.randint(0, 60)))
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        out.append(tok.encode(chat, add_special_tokens=False))
    return out


def summarize(prof, num_steps: int, wall_s: float, tokens: int) -> dict:
    count, total = defaultdict(int), defaultdict(float)
    events = prof.events()
    kinds, _ = kernel_kinds(events)
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "batchgen.sample":
            count[e.name] += 1
            total[e.name] += e.device_time
    top = sorted(total, key=lambda n: -total[n])[:18]
    return {"steps": num_steps, "wall_ms_per_step": round(1e3 * wall_s / num_steps, 3),
            "tokens_per_step": round(tokens / num_steps, 1),
            "kind_ms_per_step": {k: round(v / 1e3 / num_steps, 3) for k, v in kinds.items()},
            "kernel_ms_per_step": round(sum(total.values()) / 1e3 / num_steps, 3),
            "top": [{"name": n[:90], "per_step": round(count[n] / num_steps, 2),
                     "us_per_step": round(total[n] / num_steps, 1)} for n in top]}


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    from batchgen import Engine, EngineConfig, SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--windows", default="20:40,200:220,250:290")
    ap.add_argument("--penalty", type=float, default=1.0)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    windows = [tuple(int(x) for x in w.split(":")) for w in args.windows.split(",")]
    model, tok = build(args.tokenizer)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.7, top_p=0.9,
                            repetition_penalty=args.penalty, ignore_eos=True)
    report = {"seqs": args.seqs, "penalty": args.penalty, "windows": []}
    with Engine(model, tok, EngineConfig(max_num_seqs=args.seqs)) as engine:
        for p in prompts(tok, 2 * args.seqs):
            engine.add_request(p, params)
        step = 0
        for first, last in windows:
            while step < first:
                engine.step()
                step += 1
            torch.cuda.synchronize()
            tokens0 = engine.num_generated_tokens
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                while step < last:
                    engine.step()
                    step += 1
                torch.cuda.synchronize()
                wall_s = time.perf_counter() - t0
            w = summarize(prof, last - first, wall_s, engine.num_generated_tokens - tokens0)
            w["window"] = f"{first}:{last}"
            report["windows"].append(w)
            print(json.dumps(w), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""The mixed load's schedule under each `engine.admission_group` (pure Python, no model: seconds on a CPU).

The scheduler runs `batchgen bench --workload mixed`'s requests (batchgen.bench.mixed.mixed_workload: 256
sequences, 8,192 tokens a step, a 56,000-block cache as on the H200) with a fake runner that samples token 7, and
counts the steps: how many hold prompt tokens (mixed steps, run eagerly) and how many prompt tokens each, how many
are decode only and how many rows those hold. At admission_group 1 it gives the H200 run's counts (2026-12-02:
1,414 mixed steps of ~1,450 prompt tokens, 3,305 decode steps of 212 rows, without the warm-up's). Which group is
fastest is the GPU's to say (`batchgen bench --workload mixed --ab-set engine.admission_group=K`).

    .venv/bin/python bench/admission_schedule.py [--requests 2000] [--groups 1,2,4,8]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batchgen.bench.mixed import mixed_workload  # noqa: E402
from batchgen.engine.batch import StepOutput  # noqa: E402
from batchgen.engine.block_manager import BlockManager  # noqa: E402
from batchgen.engine.request import Request  # noqa: E402
from batchgen.engine.scheduler import Scheduler  # noqa: E402
from batchgen.sampling_params import SamplingParams  # noqa: E402


def schedule_counts(prompts: list[list[int]], output_lens: list[int], admission_group: int, max_num_seqs: int = 256,
                    max_num_batched_tokens: int = 8192, num_blocks: int = 56_000, block_size: int = 16) -> dict:
    """Step counts of the load under one admission group (every request run to its output length)."""
    s = Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens, admission_group)
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        s.add(Request(request_id=f"r{i}", prompt_token_ids=prompt, seed=0, eos_token_ids=frozenset(),
                      params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                      max_model_len=max(map(len, prompts)) + max(output_lens) + 1))
    steps = mixed = prompt_tokens = decode_rows = 0
    while s.has_work:
        batch = s.schedule()
        s.update(batch, StepOutput([7] * batch.num_samples))
        steps += 1
        if batch.num_prefill_tokens:
            mixed += 1
            prompt_tokens += batch.num_prefill_tokens
        else:
            decode_rows += batch.num_decode_tokens
    decode = steps - mixed
    return {"admission_group": admission_group, "steps": steps, "mixed_steps": mixed, "prompt_tokens": prompt_tokens,
            "prompt_tokens_per_mixed_step": round(prompt_tokens / mixed, 1) if mixed else None,
            "decode_steps": decode, "rows_per_decode_step": round(decode_rows / decode, 1) if decode else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--groups", default="1,2,4,8")
    args = ap.parse_args()
    prompts, output_lens = mixed_workload(args.requests)
    for k in (int(x) for x in args.groups.split(",")):
        c = schedule_counts(prompts, output_lens, k)
        print(f"admission_group {k}: {c['steps']} steps; {c['mixed_steps']} mixed of "
              f"{c['prompt_tokens_per_mixed_step']} prompt tokens; {c['decode_steps']} decode of "
              f"{c['rows_per_decode_step']} rows", flush=True)


if __name__ == "__main__":
    main()

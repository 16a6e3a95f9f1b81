"""Host cost of a decode step's bookkeeping alone, no model: the scheduler (schedule + update) and building the
step's sampling inputs, at 256 running sequences, median over many steps. Faster and steadier than
bench/host_step_cost.py (which runs a tiny model, so its figures include the forward's noise), and enough to
compare two versions of the scheduler or sampler A/B on this 2-core machine.

    .venv/bin/python bench/scheduler_cost.py --context 512 2048 --penalty 1.0 1.1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from batchgen.engine.batch import StepOutput
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.request import Request
from batchgen.sample.penalty import PenaltyTable
from batchgen.sample.tensors import SamplingTensors
from batchgen.engine.scheduler import Scheduler
from batchgen.sampling_params import SamplingParams

VOCAB = 32000


def measure(num_seqs: int, context: int, penalty: float, steps: int) -> dict:
    block_size = 16
    s = Scheduler(BlockManager(num_seqs * (context // block_size + steps // block_size + 4), block_size),
                  max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * context + num_seqs)
    params = SamplingParams(max_new_tokens=steps + 8, temperature=0, ignore_eos=True, repetition_penalty=penalty)
    for i in range(num_seqs):
        s.add(Request(request_id=f"r{i}", prompt_token_ids=[(i * 7 + j) % VOCAB for j in range(context)],
                      params=params, seed=0, eos_token_ids=frozenset({2}), max_model_len=context + steps + 16))
    penalty_table = PenaltyTable(num_seqs, VOCAB, torch.device("cpu"))  # as the runner's: a row per slot
    batch = s.schedule()  # the whole prefill in one step
    s.update(batch, StepOutput([7] * batch.num_samples))
    schedule_s, build_s = [], []
    for k in range(steps):
        t0 = time.perf_counter()
        batch = s.schedule()
        t1 = time.perf_counter()
        rows = [x.sampling for x in batch.seqs if x.sampling is not None]
        SamplingTensors.build(rows, [0] * len(rows), VOCAB, torch.device("cpu"), penalty_table=penalty_table)
        t2 = time.perf_counter()
        s.update(batch, StepOutput([(k * 13 + i) % VOCAB for i in range(batch.num_samples)]))
        schedule_s.append(time.perf_counter() - t2 + t1 - t0)
        build_s.append(t2 - t1)
    return {"seqs": num_seqs, "context": context, "repetition_penalty": penalty,
            "schedule_update_ms": round(1e3 * statistics.median(schedule_s), 2),
            "sampling_build_ms": round(1e3 * statistics.median(build_s), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--penalty", type=float, nargs="+", default=[1.0, 1.1])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    for penalty in args.penalty:  # one JSON line per configuration
        for context in args.context:
            print(json.dumps(measure(args.seqs, context, penalty, args.steps)), flush=True)


if __name__ == "__main__":
    main()

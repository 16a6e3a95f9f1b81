"""A step on the device: `DeviceStep`, its inputs, moved from the host in one staging copy; once dispatched,
`InFlight` (its sampled ids on their way back to the host) or `DeferredStep` (structured output: the forward
queued, the sampling waiting for the constrained rows' bitmasks).

Besides the packed token arrays (StepArrays), a step carries the rows that go through the LM head (each sampling
sequence's last position, then the positions that score a prompt), the log-prob plan's arrays, the forced tokens
(thinking budget), the carry-over placeholders (async pipeline) and, for transformers' forward on CUDA, the Triton
prefill kernel's work list. All of them are one `to_device` call, in this order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.batch import ScheduledBatch
from batchgen.kernels.attention.prefill_launch import PrefillLaunch, prefill_launch, prefill_work
from batchgen.runner.step_arrays import StepArrays
from batchgen.runner.step_timing import BusyWindow
from batchgen.sample import logprobs as lpmod
from batchgen.sample.tensors import SamplingTensors


@dataclass
class DeviceStep:
    """S = sequences, T = packed tokens, W = longest block table, K = rows through the LM head (sampling rows in
    batch order, then prompt-scoring positions)."""

    arrays: StepArrays  # the host arrays these were copied from
    input_ids: torch.Tensor  # [T] int64 (carry-over placeholders: 0 until filled on the device)
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, W] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    keep: torch.Tensor  # [K] int64 packed positions through the LM head
    num_sampled: int  # the sampling rows among `keep`, first
    max_query_len: int
    launch: PrefillLaunch  # the Triton prefill kernel's launch for this step's longest chunk
    prefill_work: torch.Tensor | None  # the prefill kernel's work list; None: not wanted
    lp_inputs: lpmod.LogprobInputs | None  # None: no row asked for log-probs
    forced: torch.Tensor | None  # [S] int64 forced ids (-1: none); None: no forced row
    carry: list[torch.Tensor]  # [packed positions [C], source rows [C]] of the placeholders, or []

    @classmethod
    def stage(cls, batch: ScheduledBatch, arrays: StepArrays, carry: list[np.ndarray], want_prefill_work: bool,
              head_dim: int, act_bytes: int, begin: Callable[[], None],
              to_device: Callable[[list[np.ndarray]], list[torch.Tensor]]) -> DeviceStep:
        """Build the step's remaining host arrays, then `begin()` the staging slot and copy them all with one
        `to_device`. `carry`: the runner's carry-over rows (host); `want_prefill_work`: transformers' forward
        on CUDA will read the prefill kernel's work list."""
        a = arrays
        sampled = [i for i, s in enumerate(batch.seqs) if s.sampling is not None]
        keep = a.last_index[sampled]  # [S (+ P)] rows through the LM head: sampling rows, then prompt scoring
        plan = lpmod.LogprobPlan.build(batch, a.last_index) if batch.num_logprob_seqs else None
        extra = plan.host_arrays() if plan is not None else []
        if plan is not None and plan.prompt_positions is not None:
            keep = np.concatenate([keep, plan.prompt_positions])
        if batch.num_forced:
            extra.append(np.array([s.sampling.forced_token_id for s in batch.seqs if s.sampling is not None],
                                  dtype=np.int64))
        # the Triton prefill kernel's work list, for steps that run transformers' forward on CUDA, cut for its launch
        max_query_len = int(a.q_lens.max())
        launch = prefill_launch(max_query_len, head_dim, act_bytes)
        work = [prefill_work(a.q_lens, a.query_start_loc, launch.block_m)] if want_prefill_work else []
        begin()
        ids_d, pos_d, slots_d, lens_d, tables_d, qsl_d, keep_d, *rest = to_device(
            [a.input_ids, a.positions, a.slot_mapping, a.seq_lens.astype(np.int32), a.block_tables,
             a.query_start_loc.astype(np.int32), keep, *work, *extra, *carry])
        work_d = rest.pop(0) if work else None
        lp_inputs = lpmod.LogprobInputs.from_device(plan, rest) if plan is not None else None
        rest = rest[len(plan.host_arrays()):] if plan is not None else rest
        forced_d = rest.pop(0) if batch.num_forced else None
        return cls(a, ids_d, pos_d, slots_d, lens_d, tables_d, qsl_d, keep_d, len(sampled), max_query_len, launch,
                   work_d, lp_inputs, forced_d, rest)


@dataclass
class InFlight:
    """A dispatched step: its sampled ids on the device and (once `done`) in host memory."""

    tokens_gpu: torch.Tensor  # [S] int64, also the carry-over source of the next step
    tokens_host: torch.Tensor  # [S] int64, pinned on CUDA
    done: torch.cuda.Event | None  # recorded after the copy back; None on CPU (already there)
    logprobs_host: dict[str, torch.Tensor] | None = None  # LogprobResult's tensors, pinned on CUDA; None: none
    # timing events on the compute stream around the step's device work (after the host prepared it), so
    # gaps between steps, where the device waits for the host, are not counted as busy; None on CPU
    busy: BusyWindow | None = None


# structured output
@dataclass
class DeferredStep:
    """A dispatched step whose forward is queued but whose sampling waits for its constrained rows' bitmasks
    (sample/grammar.py says why); `ModelRunner.sample_deferred` queues the rest of the step."""

    logits: torch.Tensor  # [S + P, V] the LM head's rows: S sampling rows (batch order), then P prompt-scoring
    sampling: SamplingTensors
    num_sampled: int  # S
    forced: torch.Tensor | None  # [S] int64 forced ids (-1: none), thinking budget
    lp_inputs: lpmod.LogprobInputs | None
    busy: BusyWindow | None

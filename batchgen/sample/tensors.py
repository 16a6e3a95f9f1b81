"""SamplingTensors: a step's per-row sampling inputs, built on the host and moved to the device in one copy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.batch import SeqSampling
from batchgen.sample.noise import row_noise_keys
from batchgen.sample.penalty import PenaltyTable


@dataclass
class SamplingTensors:
    """Per-row sampling inputs on the logits' device. S = rows, V = vocabulary."""

    temperature: torch.Tensor  # [S] float32, 0 for greedy rows
    top_k: torch.Tensor  # [S] int64, vocab size when off
    top_p: torch.Tensor  # [S] float32
    min_p: torch.Tensor  # [S] float32
    noise_key: torch.Tensor  # [S] int64 in [0, 2^32)
    penalty: torch.Tensor | None  # [S] float32 repetition penalty (1.0: off); None when no row uses the table
    presence: torch.Tensor | None  # [S] float32 presence penalty (0.0: off); None with penalty
    frequency: torch.Tensor | None  # [S] float32 frequency penalty (0.0: off); None with penalty
    penalty_slot: torch.Tensor | None  # [S] int64: each row's PenaltyTable row (the scratch row if none)
    penalty_counts: torch.Tensor | None  # [slots + 1, V] int32: the PenaltyTable, this step's new rows filled
    bias_rows: torch.Tensor | None  # [K] int64 with bias_token_ids, bias_values: logits[row, token] += value
    bias_token_ids: torch.Tensor | None  # [K] int64
    bias_values: torch.Tensor | None  # [K] float32
    suppress_rows: torch.Tensor | None  # [K] int64 with suppress_token_ids: logits[row, token] = -inf
    suppress_token_ids: torch.Tensor | None  # [K] int64
    any_random: bool
    any_repetition: bool  # some row's repetition penalty is not 1.0
    any_additive: bool  # some row has a presence or frequency penalty
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # structured output: the constrained rows and their bitmasks, applied to the logits before
    # everything else (sample/grammar_mask.py); the bitmask is set by the runner once the host has filled it
    grammar_rows: torch.Tensor | None = None  # [G] int64 rows with a grammar, in bitmask order; None: none
    grammar_bitmask: torch.Tensor | None = None  # [G, ceil(V / 32)] int32, bit set = token allowed

    @classmethod
    def build(cls, rows: list[SeqSampling], positions: list[int], vocab_size: int, device: torch.device,
              to_device: Callable[[list[np.ndarray]], list[torch.Tensor]] | None = None,
              penalty_table: PenaltyTable | None = None) -> SamplingTensors:
        """`positions[i]`: position of the token row i samples (noise depends on it). `to_device` moves a
        list of host arrays to the device in one go (the runner's pinned staging); default: one copy each.
        Rows with a repetition, presence or frequency penalty need `penalty_table`; those with a `penalty_history` (re)initialise
        their slot's row of it here, queued before this step's sampling."""
        arrays: dict[str, np.ndarray] = {
            "temperature": np.array([r.temperature for r in rows], dtype=np.float32),
            "top_k": np.array([r.top_k if 0 < r.top_k < vocab_size else vocab_size for r in rows], dtype=np.int64),
            "top_p": np.array([r.top_p for r in rows], dtype=np.float32),
            "min_p": np.array([r.min_p for r in rows], dtype=np.float32),
            "noise_key": row_noise_keys([r.seed for r in rows], positions),
        }
        penalised = [i for i, r in enumerate(rows) if r.uses_penalty_table]
        if penalised:
            if penalty_table is None:
                raise ValueError("a repetition, presence or frequency penalty needs a PenaltyTable")
            bad = [rows[i].penalty_slot for i in penalised if not 0 <= rows[i].penalty_slot < penalty_table.num_slots]
            assert not bad, f"penalty slots {bad} outside the table's {penalty_table.num_slots} rows"
            arrays["penalty"] = np.array([r.repetition_penalty for r in rows], dtype=np.float32)
            arrays["presence"] = np.array([r.presence_penalty for r in rows], dtype=np.float32)
            arrays["frequency"] = np.array([r.frequency_penalty for r in rows], dtype=np.float32)
            arrays["penalty_slot"] = np.array([r.penalty_slot if r.uses_penalty_table else
                                               penalty_table.scratch_slot for r in rows], dtype=np.int64)
            fresh = [rows[i] for i in penalised if rows[i].penalty_history is not None]
            if fresh:  # slots (re)assigned since their last step: clear and fill their rows first
                histories = [np.asarray(r.penalty_history, dtype=np.int64) for r in fresh]
                arrays["init_slots"] = np.array([r.penalty_slot for r in fresh], dtype=np.int64)
                arrays["init_prompt_slots"] = np.repeat(arrays["init_slots"], [r.penalty_num_prompt for r in fresh])
                arrays["init_prompt_ids"] = np.concatenate([h[:r.penalty_num_prompt] for r, h in zip(fresh, histories)])
                arrays["init_output_slots"] = np.repeat(arrays["init_slots"],
                                                        [len(h) - r.penalty_num_prompt for r, h in zip(fresh, histories)])
                arrays["init_output_ids"] = np.concatenate([h[r.penalty_num_prompt:]
                                                            for r, h in zip(fresh, histories)])
        if any(r.logit_bias for r in rows):
            arrays["bias_rows"] = np.array([i for i, r in enumerate(rows) for _ in r.logit_bias], dtype=np.int64)
            arrays["bias_token_ids"] = np.array([t for r in rows for t, _ in r.logit_bias], dtype=np.int64)
            arrays["bias_values"] = np.array([b for r in rows for _, b in r.logit_bias], dtype=np.float32)
        if any(r.suppressed_token_ids for r in rows):
            arrays["suppress_rows"] = np.array([i for i, r in enumerate(rows) for _ in r.suppressed_token_ids],
                                               dtype=np.int64)
            arrays["suppress_token_ids"] = np.array([t for r in rows for t in r.suppressed_token_ids], dtype=np.int64)
        # structured output
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            arrays["grammar_rows"] = np.array(constrained, dtype=np.int64)
        if to_device is None:
            def to_device(host: list[np.ndarray]) -> list[torch.Tensor]:
                return [torch.from_numpy(a).to(device, non_blocking=True) for a in host]
        tensors = dict(zip(arrays, to_device(list(arrays.values()))))
        if "init_slots" in tensors:
            penalty_table.init_rows(tensors["init_slots"], tensors["init_prompt_slots"], tensors["init_prompt_ids"],
                                    tensors["init_output_slots"], tensors["init_output_ids"])
        return cls(
            temperature=tensors["temperature"], top_k=tensors["top_k"], top_p=tensors["top_p"],
            min_p=tensors["min_p"], noise_key=tensors["noise_key"],
            penalty=tensors.get("penalty"), presence=tensors.get("presence"), frequency=tensors.get("frequency"),
            penalty_slot=tensors.get("penalty_slot"), penalty_counts=penalty_table.table() if penalised else None,
            bias_rows=tensors.get("bias_rows"), bias_token_ids=tensors.get("bias_token_ids"),
            bias_values=tensors.get("bias_values"),
            suppress_rows=tensors.get("suppress_rows"), suppress_token_ids=tensors.get("suppress_token_ids"),
            any_random=any(r.temperature > 0 for r in rows),
            any_repetition=any(r.repetition_penalty != 1.0 for r in rows),
            any_additive=any(r.presence_penalty != 0.0 or r.frequency_penalty != 0.0 for r in rows),
            any_top_k=any(0 < r.top_k < vocab_size and r.temperature > 0 for r in rows),
            any_top_p=any(r.top_p < 1.0 and r.temperature > 0 for r in rows),
            any_min_p=any(r.min_p > 0.0 and r.temperature > 0 for r in rows),
            grammar_rows=tensors.get("grammar_rows"),  # structured output
        )

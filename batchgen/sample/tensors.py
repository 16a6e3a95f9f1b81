"""SamplingTensors: a step's per-row sampling inputs, derived from each row's SamplingParams here and nowhere
else, built on the host and moved to the device in one copy.

A sampling option that is one value a row is a line of `PER_ROW` (or `PER_ROW_PENALTY`) naming its
SamplingParams field, and the SamplingTensors field of the same name; its transform lives in `sampler.py` (and
`kernels/sample/`). Token lists (logit bias, suppressed ids) and the penalty table's rows are packed by the
helpers below. Values are read once per distinct SamplingParams object of the step (a job has one, or one per
distinct per-row setting) and spread to its rows by index: a pydantic field read costs several times a plain
attribute's, and a step has hundreds of rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.batch import SeqSampling
from batchgen.sample.noise import row_noise_keys
from batchgen.sample.penalty import PenaltyTable

# (SamplingTensors field, SamplingParams field, dtype): one value a row, every step that samples. top_k is
# then clamped to the vocabulary (0 -> off -> vocab size).
PER_ROW = (("temperature", "temperature", np.float32), ("top_k", "top_k", np.int64),
           ("top_p", "top_p", np.float32), ("min_p", "min_p", np.float32))
# the same, built only when some row of the step uses the PenaltyTable (None otherwise)
PER_ROW_PENALTY = (("penalty", "repetition_penalty", np.float32), ("presence", "presence_penalty", np.float32),
                   ("frequency", "frequency_penalty", np.float32))
# host arrays that become SamplingTensors fields as they are (the init_* arrays go to the PenaltyTable instead)
_COPIED = (*(name for name, _, _ in PER_ROW), "noise_key", *(name for name, _, _ in PER_ROW_PENALTY), "penalty_slot",
           "bias_rows", "bias_token_ids", "bias_values", "suppress_rows", "suppress_token_ids", "grammar_rows")


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

    @staticmethod
    def needed(rows: list[SeqSampling]) -> bool:
        """Whether some row needs the sampler: False when every row is plain greedy (the argmax of the raw
        logits is its token, and nothing needs copying)."""
        return not all(r.params.temperature == 0 and not r.params.uses_penalty_table and not r.suppressed_token_ids
                       and not r.params.logit_bias and r.grammar is None for r in rows)

    @classmethod
    def build(cls, rows: list[SeqSampling], positions: list[int], vocab_size: int, device: torch.device,
              to_device: Callable[[list[np.ndarray]], list[torch.Tensor]] | None = None,
              penalty_table: PenaltyTable | None = None) -> SamplingTensors:
        """`positions[i]`: position of the token row i samples (noise depends on it). `to_device` moves a
        list of host arrays to the device in one go (the runner's pinned staging); default: one copy each.
        Rows with a repetition, presence or frequency penalty need `penalty_table`; those with a
        `penalty_history` (re)initialise their slot's row of it here, queued before this step's sampling."""
        params = _StepParams(rows)
        arrays = params.per_row(PER_ROW)
        arrays["top_k"] = np.where((arrays["top_k"] > 0) & (arrays["top_k"] < vocab_size), arrays["top_k"],
                                   vocab_size)
        arrays["noise_key"] = row_noise_keys([r.seed for r in rows], positions)
        uses_table = params.per_row_value(lambda p: p.uses_penalty_table, bool)
        penalised = bool(uses_table.any())
        if penalised:
            arrays.update(_penalty_arrays(rows, params, uses_table, penalty_table))
        arrays.update(_token_lists(rows, params))
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]  # structured output
        if constrained:
            arrays["grammar_rows"] = np.array(constrained, dtype=np.int64)
        if to_device is None:
            def to_device(host: list[np.ndarray]) -> list[torch.Tensor]:
                return [torch.from_numpy(a).to(device, non_blocking=True) for a in host]
        tensors = dict(zip(arrays, to_device(list(arrays.values()))))
        if "init_slots" in tensors:
            penalty_table.init_rows(tensors["init_slots"], tensors["init_prompt_slots"], tensors["init_prompt_ids"],
                                    tensors["init_output_slots"], tensors["init_output_ids"])
        return cls(**{name: tensors.get(name) for name in _COPIED},
                   penalty_counts=penalty_table.table() if penalised else None, **params.flags(vocab_size))


class _StepParams:
    """The step's distinct SamplingParams objects and each row's index among them."""

    def __init__(self, rows: list[SeqSampling]) -> None:
        ids = np.fromiter((id(r.params) for r in rows), dtype=np.uint64, count=len(rows))
        _, first, self.row_index = np.unique(ids, return_index=True, return_inverse=True)  # [S] int64
        self.distinct = [rows[i].params for i in first]  # SamplingParams, one per object

    def per_row_value(self, value: Callable, dtype) -> np.ndarray:
        """[S] `value(params)` of each row's SamplingParams."""
        return np.array([value(p) for p in self.distinct], dtype=dtype)[self.row_index]

    def per_row(self, fields) -> dict[str, np.ndarray]:
        """One [S] array a declared (SamplingTensors field, SamplingParams field, dtype)."""
        return {name: np.array([getattr(p, source) for p in self.distinct], dtype=dtype)[self.row_index]
                for name, source, dtype in fields}

    def flags(self, vocab_size: int) -> dict[str, bool]:
        """Which transforms some row of the step uses (the others are skipped)."""
        params = self.distinct
        return dict(
            any_random=any(p.temperature > 0 for p in params),
            any_repetition=any(p.repetition_penalty != 1.0 for p in params),
            any_additive=any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params),
            any_top_k=any(0 < p.top_k < vocab_size and p.temperature > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 and p.temperature > 0 for p in params),
            any_min_p=any(p.min_p > 0.0 and p.temperature > 0 for p in params),
        )


def _penalty_arrays(rows: list[SeqSampling], params: _StepParams, uses_table: np.ndarray,
                    penalty_table: PenaltyTable | None) -> dict[str, np.ndarray]:
    """The penalties of every row, each row's PenaltyTable row (`uses_table` [S] bool: the row has one), and the
    histories that fill newly assigned rows."""
    if penalty_table is None:
        raise ValueError("a repetition, presence or frequency penalty needs a PenaltyTable")
    slots = np.fromiter((r.penalty_slot for r in rows), dtype=np.int64, count=len(rows))
    bad = [int(s) for s in slots[uses_table] if not 0 <= s < penalty_table.num_slots]
    assert not bad, f"penalty slots {bad} outside the table's {penalty_table.num_slots} rows"
    arrays = params.per_row(PER_ROW_PENALTY)
    arrays["penalty_slot"] = np.where(uses_table, slots, penalty_table.scratch_slot)
    fresh = [r for r, uses in zip(rows, uses_table) if uses and r.penalty_history is not None]
    if fresh:  # slots (re)assigned since their last step: clear and fill their rows first
        histories = [np.asarray(r.penalty_history, dtype=np.int64) for r in fresh]
        init_slots = np.array([r.penalty_slot for r in fresh], dtype=np.int64)
        arrays["init_slots"] = init_slots
        arrays["init_prompt_slots"] = np.repeat(init_slots, [r.penalty_num_prompt for r in fresh])
        arrays["init_prompt_ids"] = np.concatenate([h[:r.penalty_num_prompt] for r, h in zip(fresh, histories)])
        arrays["init_output_slots"] = np.repeat(init_slots, [len(h) - r.penalty_num_prompt
                                                             for r, h in zip(fresh, histories)])
        arrays["init_output_ids"] = np.concatenate([h[r.penalty_num_prompt:] for r, h in zip(fresh, histories)])
    return arrays


def _token_lists(rows: list[SeqSampling], params: _StepParams) -> dict[str, np.ndarray]:
    """(row, token) pairs of the rows' logit bias (with its values) and suppressed ids; none when no row has any."""
    arrays: dict[str, np.ndarray] = {}
    if any(p.logit_bias for p in params.distinct):
        biases = [r.params.logit_bias for r in rows]
        arrays["bias_rows"] = np.array([i for i, bias in enumerate(biases) for _ in bias], dtype=np.int64)
        arrays["bias_token_ids"] = np.array([t for bias in biases for t, _ in bias], dtype=np.int64)
        arrays["bias_values"] = np.array([b for bias in biases for _, b in bias], dtype=np.float32)
    if any(r.suppressed_token_ids for r in rows):
        arrays["suppress_rows"] = np.array([i for i, r in enumerate(rows) for _ in r.suppressed_token_ids],
                                           dtype=np.int64)
        arrays["suppress_token_ids"] = np.array([t for r in rows for t in r.suppressed_token_ids], dtype=np.int64)
    return arrays

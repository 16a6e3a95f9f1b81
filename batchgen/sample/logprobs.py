"""Log-probs on the device, from the logits a step already has: the model's own distribution, log_softmax of
the raw logits in fp32, before penalties, temperature and filters (what vLLM reports by default). Only the
values and ids asked for leave the device; nothing here synchronises with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.batch import ScheduledBatch

PROMPT_ROWS_PER_CHUNK = 1024  # rows of fp32 logits alive at once while scoring a prompt: [1024, V] fp32


@dataclass
class LogprobPlan:
    """A step's log-prob work, built on the host from its batch. S = sampling rows, R = those that asked,
    P = prompt positions scored. Empty parts are None: a step where no row asks has no plan at all."""

    sample_rows: np.ndarray | None  # [R] int64: rows of the step's sampling logits that asked
    top_k: int  # the largest K among them (0: the sampled token's log-prob only)
    prompt_positions: np.ndarray | None  # [P] int64 packed token positions whose logits score a prompt token
    prompt_targets: np.ndarray | None  # [P] int64 the prompt token each of them scores

    @classmethod
    def build(cls, batch: ScheduledBatch, last_index: np.ndarray) -> LogprobPlan | None:
        """`last_index` [S_all] (batch order): packed position of each sequence's last token (StepArrays)."""
        rows, ks, positions, targets = [], [], [], []
        row = 0
        for i, s in enumerate(batch.seqs):
            if s.prompt_logprob_targets:
                first = int(last_index[i]) - s.num_new_tokens + 1 + s.prompt_logprob_offset
                positions.append(np.arange(first, first + len(s.prompt_logprob_targets), dtype=np.int64))
                targets.append(np.asarray(s.prompt_logprob_targets, dtype=np.int64))
            if s.sampling is not None:
                if s.sampling.logprobs >= 0:
                    rows.append(row)
                    ks.append(s.sampling.logprobs)
                row += 1
        if not rows and not positions:
            return None
        return cls(sample_rows=np.array(rows, dtype=np.int64) if rows else None, top_k=max(ks, default=0),
                   prompt_positions=np.concatenate(positions) if positions else None,
                   prompt_targets=np.concatenate(targets) if targets else None)

    def host_arrays(self) -> list[np.ndarray]:
        """What goes to the device, in `LogprobInputs.from_device` order."""
        return [a for a in (self.sample_rows, self.prompt_positions, self.prompt_targets) if a is not None]


@dataclass
class LogprobInputs:
    """The plan's arrays on the device."""

    sample_rows: torch.Tensor | None  # [R] int64
    top_k: int
    prompt_positions: torch.Tensor | None  # [P] int64
    prompt_targets: torch.Tensor | None  # [P] int64

    @classmethod
    def from_device(cls, plan: LogprobPlan, tensors: list[torch.Tensor]) -> LogprobInputs:
        it = iter(tensors)
        rows = next(it) if plan.sample_rows is not None else None
        pos = next(it) if plan.prompt_positions is not None else None
        return cls(rows, plan.top_k, pos, next(it) if pos is not None else None)


@dataclass
class LogprobResult:
    """Device tensors of one step's log-probs (StepOutput's fields once on the host)."""

    logprobs: torch.Tensor | None  # [R] float32
    top_token_ids: torch.Tensor | None  # [R, K] int64 (None when K = 0)
    top_logprobs: torch.Tensor | None  # [R, K] float32
    prompt_logprobs: torch.Tensor | None  # [P] float32

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if v is not None}


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logits [R, V] raw, tokens [R] int64 -> (log-prob of each token [R] fp32, top-K ids [R, K] int64 and
    log-probs [R, K] fp32, most likely first; None, None when top_k is 0).
    log_softmax, not logsumexp: torch's softmax kernels reduce each row in one block whose shape depends on V
    only, so a row's values do not depend on how many rows the step has (engine.deterministic needs that);
    logsumexp goes through the generic reduction, which may split a row differently as R changes."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = lp.gather(1, tokens[:, None])[:, 0]
    if top_k == 0:
        return chosen, None, None
    values, ids = lp.topk(top_k, dim=-1)
    return chosen, ids, values


def prompt_token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                          rows_per_chunk: int = PROMPT_ROWS_PER_CHUNK) -> torch.Tensor:
    """logits [P, V] raw (any dtype), targets [P] int64 -> [P] fp32 log-prob of each target, in chunks of
    rows so that no [P, V] fp32 copy exists (a long prompt's logits are large already). Per-row log_softmax as
    in token_logprobs: a position's value does not depend on the chunking."""
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for lo in range(0, logits.shape[0], rows_per_chunk):
        lp = torch.log_softmax(logits[lo:lo + rows_per_chunk].float(), dim=-1)
        out[lo:lo + rows_per_chunk] = lp.gather(1, targets[lo:lo + rows_per_chunk, None])[:, 0]
    return out


def compute(sample_logits: torch.Tensor, tokens: torch.Tensor, prompt_logits: torch.Tensor | None,
            inputs: LogprobInputs) -> LogprobResult:
    """A step's log-probs: `sample_logits` [S, V] and `tokens` [S] are the sampling rows' logits and final
    ids (forced ones included); `prompt_logits` [P, V] the logits at `inputs.prompt_positions`."""
    lp = top_ids = top_lp = None
    if inputs.sample_rows is not None:
        rows = inputs.sample_rows
        lp, top_ids, top_lp = token_logprobs(sample_logits[rows], tokens[rows], inputs.top_k)
    prompt = None
    if inputs.prompt_positions is not None:
        prompt = prompt_token_logprobs(prompt_logits, inputs.prompt_targets)
    return LogprobResult(lp, top_ids, top_lp, prompt)

"""PenaltyTable: which tokens each penalised sequence has seen, and how often it generated them, on the device.

The repetition penalty needs, every step, the set of tokens in each sampled sequence's history (prompt and
output); the presence and frequency penalties need how many times each token occurs in its output. Rebuilding
those histories on the host and copying them every step costs O(rows x context) host time per step (at 256
sequences it doubled the host's share of a step). Instead the scheduler gives each running penalised sequence
a slot (a row of this table) and sends its history once, when the slot is (re)assigned; after every step the
runner counts each penalised row's sampled token in its slot's row, on the device, in stream order. With the
async pipeline nothing else is needed: step N's counts are queued before step N+1 reads the table.

A row holds int32 entries: bit 0 is set for tokens of the prompt, and entry >> 1 is how many times the output
holds the token. So `entry != 0` is "seen" for the repetition penalty and `entry >> 1` the output count.

Invariants: a slot belongs to one running sequence at a time; a new owner's first sampling step clears the
row and writes its whole history before the sampler reads it (queued after any count by the previous owner).
Rows of a step that do not penalise point at the scratch row (`scratch_slot`) with neutral penalties: counting
them there is harmless and their logits are left unchanged.
"""

from __future__ import annotations

import torch

PROMPT_BIT = 1  # entry | 1: the token is in the prompt
OUTPUT_ONE = 2  # entry + 2: one more occurrence in the output


class PenaltyTable:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.scratch_slot = num_slots  # the extra last row
        self.vocab_size = vocab_size
        self.device = device
        self.counts: torch.Tensor | None = None  # [num_slots + 1, V] int32, allocated by the first penalised step
        self._prompt_bit: torch.Tensor | None = None  # [] int32 PROMPT_BIT on the device

    def table(self) -> torch.Tensor:
        """The [num_slots + 1, V] int32 table (allocated on first use)."""
        if self.counts is None:
            self.counts = torch.zeros(self.num_slots + 1, self.vocab_size, dtype=torch.int32, device=self.device)
            self._prompt_bit = torch.full((), PROMPT_BIT, dtype=torch.int32, device=self.device)
        return self.counts

    # Hazard: `counts[idx] = 1` makes a host scalar tensor and copies it to the device, which waits for the
    # device to finish its queued work: the async pipeline's overlap would be lost (measured with the earlier
    # bool table: a 256-sequence step went from 11 to 16 ms). The writes below take a scalar argument or a
    # device tensor instead.

    def init_rows(self, slots: torch.Tensor, prompt_slots: torch.Tensor, prompt_ids: torch.Tensor,
                  output_slots: torch.Tensor, output_ids: torch.Tensor) -> None:
        """Clear the rows of `slots` [K] int64, then mark the prompt ids [P] int64 in rows prompt_slots [P] and
        count the output ids [O] int64 in rows output_slots [O]."""
        counts = self.table()
        counts.index_fill_(0, slots, 0)
        counts.index_put_((prompt_slots, prompt_ids), self._prompt_bit)  # repeats set the same bit
        if output_ids.numel():
            counts.index_put_((output_slots, output_ids), torch.full_like(output_ids, OUTPUT_ONE, dtype=torch.int32),
                              accumulate=True)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each sampled token [S] int64 in its row's slot [S] int64 (after the step's sampling). Scratch
        rows may repeat: accumulation adds them all."""
        self.table().index_put_((slots, tokens), torch.full_like(tokens, OUTPUT_ONE, dtype=torch.int32),
                                accumulate=True)

    def close(self) -> None:
        self.counts = self._prompt_bit = None

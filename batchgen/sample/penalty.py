"""PenaltyTable: which tokens each penalised sequence has seen (prompt + output), kept on the device.

The repetition penalty needs, every step, the set of tokens in each sampled sequence's history. Rebuilding
those histories on the host and copying them every step costs O(rows x context) host time per step (at 256
sequences it doubled the host's share of a step). Instead the scheduler gives each running penalised sequence
a slot (a row of this table) and sends its history once, when the slot is (re)assigned; after every step the
runner marks each penalised row's sampled token in its slot's row, on the device, in stream order. With the
async pipeline nothing else is needed: step N's marks are queued before step N+1 reads the table.

Invariants: a slot belongs to one running sequence at a time; a new owner's first sampling step clears the
row and writes its whole history before the sampler reads it (queued after any mark by the previous owner).
Rows of a step that do not penalise point at the scratch row (`scratch_slot`) with a penalty of 1.0: marking
them there is harmless and the penalty leaves their logits unchanged.
"""

from __future__ import annotations

import torch


class PenaltyTable:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.scratch_slot = num_slots  # the extra last row
        self.vocab_size = vocab_size
        self.device = device
        self.seen: torch.Tensor | None = None  # [num_slots + 1, V] bool, allocated by the first penalised step
        self._true: torch.Tensor | None = None  # [] bool True on the device

    def table(self) -> torch.Tensor:
        """The [num_slots + 1, V] bool table (allocated on first use)."""
        if self.seen is None:
            self.seen = torch.zeros(self.num_slots + 1, self.vocab_size, dtype=torch.bool, device=self.device)
            self._true = torch.ones((), dtype=torch.bool, device=self.device)  # the marks' value, on the device
        return self.seen

    # Hazard: `seen[idx] = True` makes a host scalar tensor and copies it to the device, which waits for the
    # device to finish its queued work: the async pipeline's overlap would be lost (measured: a 256-sequence
    # step went from 11 to 16 ms). The writes below take a scalar argument or a device tensor instead.

    def init_rows(self, slots: torch.Tensor, id_slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Clear the rows of `slots` [K] int64, then mark ids [N] int64 in the rows id_slots [N] int64."""
        seen = self.table()
        seen.index_fill_(0, slots, False)
        seen.index_put_((id_slots, ids), self._true)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Mark each sampled token [S] int64 in its row's slot [S] int64 (after the step's sampling)."""
        self.table().index_put_((slots, tokens), self._true)

    def close(self) -> None:
        self.seen = self._true = None

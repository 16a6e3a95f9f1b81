"""Think markers of reasoning models: where a completion's reasoning ends and its answer begins, and the
thinking budget's state. Pure Python, over token ids.

One rule decides both the output split and the budget: the think block opens at the first start marker of the
completion, or before the completion when the prompt left one open (a chat template that ends with "<think>\\n":
its last start marker comes after its last end marker); it closes at the first end marker after that. Its
reasoning tokens are those strictly between the markers (neither marker counts), generated tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

AUTO_MARKERS = ("<think>", "</think>")  # the tokens `auto` looks for in a tokenizer's vocabulary


@dataclass(frozen=True)
class ReasoningMarkers:
    start_ids: tuple[int, ...]  # the start marker's token ids (usually one token)
    end_ids: tuple[int, ...]

    @classmethod
    def from_strings(cls, tokenizer, start: str, end: str) -> ReasoningMarkers:
        ids = [tuple(tokenizer.encode(s, add_special_tokens=False)) for s in (start, end)]
        if not ids[0] or not ids[1]:
            raise ValueError(f"think markers {start!r} / {end!r} encode to no tokens")
        return cls(ids[0], ids[1])

    @classmethod
    def auto(cls, tokenizer) -> ReasoningMarkers | None:
        """The tokenizer's "<think>" / "</think>" tokens when its vocabulary has both, else None."""
        if tokenizer is None:
            return None
        vocab = tokenizer.get_vocab()
        if not all(m in vocab for m in AUTO_MARKERS):
            return None
        return cls((vocab[AUTO_MARKERS[0]],), (vocab[AUTO_MARKERS[1]],))

    def opened_by(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt ends inside a think block (its last start marker after its last end marker)."""
        start, end = _last(prompt_ids, self.start_ids), _last(prompt_ids, self.end_ids)
        return start >= 0 and start > end

    def split(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> tuple[int, int, int] | None:
        """(first reasoning index, end of reasoning, first answer index) into `output_ids`, or None when the
        completion has no think block. Unclosed (cut by length): reasoning runs to the end, the answer is empty."""
        if self.opened_by(prompt_ids):
            first = 0
        else:
            at = _first(output_ids, self.start_ids, 0)
            if at < 0:
                return None
            first = at + len(self.start_ids)
        end = _first(output_ids, self.end_ids, first)
        if end < 0:
            return first, len(output_ids), len(output_ids)
        return first, end, end + len(self.end_ids)


class ThinkingBudget:
    """One sequence's think-block state while it generates: how many reasoning tokens so far, and whether the
    end marker (one token) must be its next token. Fed every appended output token, in order."""

    def __init__(self, markers: ReasoningMarkers, budget: int, prompt_ids: Sequence[int]) -> None:
        assert len(markers.end_ids) == 1, "a thinking budget needs a one-token end marker"
        self.markers, self.budget = markers, budget
        self.end_id = markers.end_ids[0]
        self.phase = "inside" if markers.opened_by(prompt_ids) else "before"  # -> "inside" -> "after"
        self.num_reasoning_tokens = 0
        self._output: list[int] = []  # only while "before": to find a multi-token start marker

    def append(self, token_id: int) -> None:
        if self.phase == "inside":
            if token_id == self.end_id:
                self.phase = "after"
            else:
                self.num_reasoning_tokens += 1
        elif self.phase == "before":
            self._output.append(token_id)
            n = len(self.markers.start_ids)
            if tuple(self._output[-n:]) == self.markers.start_ids:
                self.phase, self._output = "inside", []

    def forced_token(self) -> int:
        """The end marker's id when the budget is spent inside the think block, else -1."""
        return self.end_id if self.phase == "inside" and self.num_reasoning_tokens >= self.budget else -1

    def may_schedule_with(self, num_pending: int) -> bool:
        """Whether the next token may be scheduled while `num_pending` tokens are still unknown to the host:
        not when one of them could make the budget due (the force must land on exactly the next token)."""
        if num_pending == 0 or self.phase == "after":
            return True
        if self.phase == "inside":
            return self.num_reasoning_tokens + num_pending < self.budget
        return self.budget > 0  # a pending start marker with budget 0 would make the end marker due at once


def _first(ids: Sequence[int], pattern: tuple[int, ...], start: int) -> int:
    n = len(pattern)
    for i in range(start, len(ids) - n + 1):
        if ids[i] == pattern[0] and tuple(ids[i:i + n]) == pattern:
            return i
    return -1


def _last(ids: Sequence[int], pattern: tuple[int, ...]) -> int:
    n = len(pattern)
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == pattern[0] and tuple(ids[i:i + n]) == pattern:
            return i
    return -1

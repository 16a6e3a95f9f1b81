"""Workers: which part of the rows this process generates. Each worker computes its part alone."""

from __future__ import annotations

from dataclasses import dataclass

ROWS_PER_UNIT = 1024  # rows are dealt to workers in contiguous units, so each reads its source sequentially


@dataclass(frozen=True)
class WorkerInfo:
    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"worker index {self.index} is not in [0, {self.count})")

    def owns(self, position: int) -> bool:
        return (position // ROWS_PER_UNIT) % self.count == self.index

"""RunResult: what one worker's run of a job produced (the CLI prints it; tests read it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunResult:
    out_dir: Path
    rows_committed: int
    rows_rejected: int
    rows_skipped: int  # already committed by earlier runs
    interrupted_by: int | None  # the signal number that stopped the run, if any
    report: dict[str, Any] = field(default_factory=dict)

"""StepTiming: where the device's time goes, by kind of step (a job's loop step was ~3 ms longer than
its steady decode step, and nothing said whether prefill, refills or a waiting device took it).

Two kinds of step: "decode" (one token per sequence, every sequence samples: replayed from a CUDA graph where
one fits) and "mixed" (any prefill tokens: prompt chunks, with or without decode rows; run eagerly). On CUDA
each step's device work sits between two timing events on the compute stream, recorded after the host prepared
it; per kind this sums
  - busy: the device time from a step's first event to its last;
  - idle: the device time between the previous collected step's last event and this step's first, i.e. the
    device waiting for the host to queue this step (a late step is charged, not the one before it).
Steps are collected in dispatch order (the engine keeps at most one in flight), so the previous step's last
event is complete whenever this one's is. Gaps over 1 ms are also kept one by one with their step's dispatch
index (`take_gaps`), for the job loop to say what the host was doing meanwhile (job/idle_trace.py). On CPU only
the counts are kept (no events).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STEP_KINDS = ("decode", "mixed")
MAX_GAPS_KEPT = 4096  # gaps over 1 ms held for `take_gaps` (a caller that never takes them holds no more)


@dataclass
class BusyWindow:
    """A dispatched step's two timing events on the compute stream, and its kind."""

    kind: str
    index: int  # the step's dispatch index: 1 for the run's first step
    start: torch.cuda.Event
    end: torch.cuda.Event


@dataclass
class StepTiming:
    busy_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))
    idle_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))
    num_steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    num_prefill_tokens: int = 0  # prompt (and recomputed) tokens of the mixed steps dispatched
    # whether idle time comes from a few long host stalls or from many short gaps
    max_idle_s: float = 0.0  # the longest single gap
    num_idle_over_1ms: int = 0  # gaps longer than 1 ms
    # (dispatch index, kind, idle s) of the gaps over 1 ms not yet taken; bounded by MAX_GAPS_KEPT
    _gaps: list[tuple[int, str, float]] = field(default_factory=list)
    _last_end: torch.cuda.Event | None = None  # the last collected step's end event

    def dispatched(self, num_prefill_tokens: int, cuda: bool) -> BusyWindow | None:
        """Count a step being queued; on CUDA, its window with the start event recorded now (on the current
        stream: the caller's compute stream), the end event left for `BusyWindow.end.record()`."""
        kind = "mixed" if num_prefill_tokens else "decode"
        self.num_steps[kind] += 1
        self.num_prefill_tokens += num_prefill_tokens
        if not cuda:
            return None
        window = BusyWindow(kind, self.num_dispatched, torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
        window.start.record()
        return window

    def collected(self, window: BusyWindow | None) -> None:
        """Add a collected step's busy time and the idle time before it (both of its events are complete)."""
        if window is None:
            return
        self.busy_s[window.kind] += window.start.elapsed_time(window.end) / 1e3
        if self._last_end is not None:
            idle_s = max(0.0, self._last_end.elapsed_time(window.start)) / 1e3
            self.idle_s[window.kind] += idle_s
            self.max_idle_s = max(self.max_idle_s, idle_s)
            if idle_s > 1e-3:
                self.num_idle_over_1ms += 1
                if len(self._gaps) < MAX_GAPS_KEPT:
                    self._gaps.append((window.index, window.kind, idle_s))
        self._last_end = window.end

    def take_gaps(self) -> list[tuple[int, str, float]]:
        """The gaps over 1 ms collected since the last call: (dispatch index of the step after the gap, its kind,
        idle seconds)."""
        gaps, self._gaps = self._gaps, []
        return gaps

    @property
    def num_dispatched(self) -> int:
        return sum(self.num_steps.values())

    @property
    def gpu_busy_s(self) -> float:
        return sum(self.busy_s.values())

    def stats(self) -> dict[str, float | int]:
        """Flat counters for Engine.stats() (seconds rounded to ms)."""
        out: dict[str, float | int] = {}
        for kind in STEP_KINDS:
            out[f"num_{kind}_steps"] = self.num_steps[kind]
            out[f"gpu_busy_s_{kind}"] = round(self.busy_s[kind], 3)
            out[f"gpu_idle_s_before_{kind}"] = round(self.idle_s[kind], 3)
        out["num_prefill_tokens"] = self.num_prefill_tokens
        out["gpu_idle_max_s"] = round(self.max_idle_s, 4)
        out["num_gpu_idle_over_1ms"] = self.num_idle_over_1ms
        return out

"""IdleTrace: what the host was doing while the device waited.

The engine keeps one step in flight: while the device runs step s-1, the host applies step s-2's tokens, hands
finished rows to the job (detokenized), commits, logs, renders new rows, schedules and prepares step s. When that
takes longer than step s-1's device time, the device idles before step s (runner/step_timing.py measures each
gap with CUDA events). This module splits the host's time between the dispatch of step s-1 and that of step s
into phases, for every pair of consecutive steps and for the ones with a gap over 1 ms, so a report says which
phase grows when the device waits (a commit, a wave of finished rows, a refill) instead of only that it did.

Phases of one span, in the order the host runs them (pass a dispatched step s-1, the next pass b step s):
  collect_wait  a: waiting for step s-2's tokens (the device's time, not the host's work)
  apply         a: applying them to the requests (the scheduler's update)
  results       a: structured output's masked draw queued; finished requests made results (detokenized text)
  finish        a: results made output rows
  commit        a: shards written and fsynced
  log           a: the throughput log
  loop          between the passes
  admit         b: rows read, rendered, tokenized and queued
  schedule      b: the scheduler's choice of step s
  prepare       b: step s's inputs built and its work queued (the device's start event is recorded partway,
                after the inputs' copies are queued: launch time after it is charged to the step, not the gap)
A span across a pass that dispatched nothing (the engine ran dry: the end of a job, a dealt feed waiting for its
next unit) is no span of consecutive steps: it is left out of the averages, and a gap after it is counted as
unmatched.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from batchgen.engine.engine import StepMarks

PHASES = ("collect_wait", "apply", "results", "finish", "commit", "log", "loop", "admit", "schedule", "prepare")
NUM_LONGEST = 8  # the longest gaps listed one by one in the report


class PassMarks(NamedTuple):
    """Host clock (time.perf_counter) marks of one job loop pass."""

    admit_started: float
    step_started: float  # Engine.step called
    engine: StepMarks | None  # that call's own marks (None: the engine ran synchronously)
    finished: float  # its results made rows
    committed: float
    logged: float


def span_phases(a: PassMarks, b: PassMarks) -> dict[str, float]:
    """Seconds in each phase from pass a's dispatch to pass b's (both dispatched a step)."""
    ea, eb = a.engine, b.engine
    return {"collect_wait": ea.collected - ea.dispatched, "apply": ea.applied - ea.collected,
            "results": ea.returned - ea.applied,
            "finish": a.finished - ea.returned, "commit": a.committed - a.finished, "log": a.logged - a.committed,
            "loop": b.admit_started - a.logged, "admit": b.step_started - b.admit_started,
            "schedule": eb.scheduled - b.step_started, "prepare": eb.dispatched - eb.scheduled}


def _index(marks: PassMarks | None) -> int | None:
    """The step a pass dispatched, or None (it dispatched nothing, or the engine ran synchronously)."""
    return None if marks is None or marks.engine is None else marks.engine.step_index


def _consecutive(a: PassMarks | None, b: PassMarks) -> bool:
    """Whether passes a and b (b right after a) dispatched two consecutive steps."""
    return _index(a) is not None and _index(b) == _index(a) + 1


@dataclass
class IdleTrace:
    num_spans: int = 0  # spans between consecutive dispatches
    span_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    num_gaps: int = 0  # gaps over 1 ms whose span was found
    idle_s: float = 0.0  # their idle time
    gap_span_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    num_unmatched: int = 0  # gaps over 1 ms after a pass that dispatched nothing (the engine ran dry)
    longest: list[dict] = field(default_factory=list)  # the NUM_LONGEST longest gaps, longest first
    # the latest passes, dry ones included: a step's gap is known one pass after it is dispatched
    _passes: deque[PassMarks] = field(default_factory=lambda: deque(maxlen=8))

    def add_pass(self, marks: PassMarks) -> None:
        prev = self._passes[-1] if self._passes else None
        self._passes.append(marks)
        if _consecutive(prev, marks):
            for phase, s in span_phases(prev, marks).items():
                self.span_s[phase] += s
            self.num_spans += 1

    def add_gaps(self, gaps: list[tuple[int, str, float]]) -> None:
        """Gaps over 1 ms (step index, kind, idle seconds: StepTiming.take_gaps), each charged to its span."""
        if not gaps:  # most passes: nothing to match
            return
        passes = list(self._passes)
        span = {_index(b): (a, b) for a, b in zip(passes, passes[1:]) if _consecutive(a, b)}
        for index, kind, idle_s in gaps:
            a, b = span.get(index, (None, None))
            if a is None:
                self.num_unmatched += 1
                continue
            phases = span_phases(a, b)
            self.num_gaps += 1
            self.idle_s += idle_s
            for phase, s in phases.items():
                self.gap_span_s[phase] += s
            self.longest.append({"step": index, "kind": kind, "idle_ms": round(1e3 * idle_s, 2),
                                 "host_ms": {k: round(1e3 * v, 2) for k, v in phases.items()}})
            self.longest.sort(key=lambda g: -g["idle_ms"])
            del self.longest[NUM_LONGEST:]

    def summary(self) -> dict:
        """For the run's report: host ms a span by phase, over all spans and over the gaps' spans."""
        return {
            "num_spans": self.num_spans,
            "host_ms_per_span": {k: round(1e3 * v / max(self.num_spans, 1), 3) for k, v in self.span_s.items()},
            "num_gaps_over_1ms": self.num_gaps, "idle_s_in_gaps": round(self.idle_s, 3),
            "host_ms_per_gap_span": {k: round(1e3 * v / max(self.num_gaps, 1), 3) for k, v in self.gap_span_s.items()},
            "num_gaps_unmatched": self.num_unmatched, "longest_gaps": self.longest,
        }

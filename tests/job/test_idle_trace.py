"""The report's idle trace: each device gap charged to the host's phases between two dispatches
(job/idle_trace.py), the gaps kept by the step timing (runner/step_timing.py), and a job's report carrying it."""

from __future__ import annotations

import json
import random

from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.engine.engine import StepMarks
from batchgen.job.idle_trace import NUM_LONGEST, PHASES, IdleTrace, PassMarks
from batchgen.runner.step_timing import BusyWindow, StepTiming
from jobutil import seed_rows, write_job, write_jsonl


def _passes(num: int, seed: int) -> list[PassMarks]:
    """`num` loop passes on one host clock with random phase lengths, pass i dispatching step i + 1."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(num):
        marks = []
        for _ in range(11):
            t += rng.uniform(0.0, 0.004)
            marks.append(t)
        admit, step, entered, scheduled, dispatched, collected, applied, returned, finished, committed, logged = marks
        out.append(PassMarks(admit, step, StepMarks(entered, scheduled, dispatched, collected, applied, returned,
                                                    i + 1), finished, committed, logged))
    return out


def test_a_gap_is_charged_to_the_phases_between_the_two_dispatches_around_it():
    passes = _passes(12, seed=3)
    trace = IdleTrace()
    for p in passes:
        trace.add_pass(p)
    trace.add_gaps([(7, "decode", 0.002)])
    s = trace.summary()
    assert s["num_spans"] == 11 and s["num_gaps_over_1ms"] == 1 and s["num_gaps_unmatched"] == 0
    # the phases tile the time from step 6's dispatch (pass 5) to step 7's (pass 6), in order, without overlap
    a, b = passes[5], passes[6]
    gap = s["longest_gaps"][0]
    assert gap["step"] == 7 and gap["kind"] == "decode" and gap["idle_ms"] == 2.0
    assert list(gap["host_ms"]) == list(PHASES) and all(v >= 0 for v in gap["host_ms"].values())
    assert abs(sum(gap["host_ms"].values()) - 1e3 * (b.engine.dispatched - a.engine.dispatched)) < 0.05
    # every span's phases add up to the run's dispatch-to-dispatch time
    total = sum(s["host_ms_per_span"].values()) * s["num_spans"]
    assert abs(total - 1e3 * (passes[-1].engine.dispatched - passes[0].engine.dispatched)) < 0.05


def test_a_gap_after_a_pass_that_dispatched_nothing_is_unmatched_and_no_span_crosses_it():
    """The engine ran dry (the last rows finishing, a dealt feed waiting for its next unit): the pass that only
    collected dispatches nothing, and the next dispatch comes after an unbounded wait. Neither the span across it
    nor a gap before the next step is charged to the host's phases."""
    passes = _passes(14, seed=5)  # pass i dispatches step i + 1
    trace = IdleTrace()
    for p in passes[:10]:  # steps 1-10, a gap before step 10 taken one pass later as the loop does
        trace.add_pass(p)
    trace.add_gaps([(10, "decode", 0.003)])
    dry = passes[10]._replace(engine=passes[10].engine._replace(step_index=None))
    trace.add_pass(dry)  # collects step 10, dispatches nothing
    resumed = [p._replace(engine=p.engine._replace(step_index=p.engine.step_index - 1)) for p in passes[11:]]
    for p in resumed:  # steps 11-13, after the wait
        trace.add_pass(p)
        trace.add_gaps([(p.engine.step_index, "mixed", 0.5)] if p.engine.step_index == 11 else [])
    s = trace.summary()
    assert (s["num_gaps_over_1ms"], s["num_gaps_unmatched"]) == (1, 1) and s["idle_s_in_gaps"] == 0.003
    assert s["num_spans"] == 9 + 2  # 1-2 ... 9-10, then 11-12 and 12-13: none across the dry pass


def test_the_longest_gaps_are_kept_longest_first_and_bounded():
    passes = _passes(40, seed=7)
    trace = IdleTrace()
    rng = random.Random(1)
    idles = {}
    for p in passes:
        trace.add_pass(p)
        index = p.engine.step_index
        if index > 1 and rng.random() < 0.7:
            idles[index] = rng.uniform(0.0011, 0.02)
            trace.add_gaps([(index, "decode", idles[index])])
    kept = trace.summary()["longest_gaps"]
    assert len(kept) == NUM_LONGEST
    assert [g["step"] for g in kept] == sorted(idles, key=lambda i: -idles[i])[:NUM_LONGEST]


class _Event:
    """A stand-in CUDA timing event on a host clock (ms)."""

    def __init__(self, t_ms: float):
        self.t_ms = t_ms

    def elapsed_time(self, end: _Event) -> float:
        return end.t_ms - self.t_ms


def test_step_timing_keeps_each_gap_over_1ms_with_its_step_index_until_taken():
    timing = StepTiming()
    t = 0.0
    expected = []
    for index, (kind, idle_ms) in enumerate([("mixed", 0.0), ("decode", 0.4), ("decode", 2.5), ("mixed", 7.0),
                                             ("decode", 1.0), ("decode", 1.2)], start=1):
        t += idle_ms
        window = BusyWindow(kind, index, _Event(t), _Event(t + 10.0))
        t += 10.0
        timing.collected(window)
        if idle_ms > 1.0:
            expected.append((index, kind, idle_ms / 1e3))
    gaps = timing.take_gaps()
    assert [(i, k) for i, k, _ in gaps] == [(i, k) for i, k, _ in expected]
    assert all(abs(a[2] - b[2]) < 1e-12 for a, b in zip(gaps, expected))
    assert timing.num_idle_over_1ms == 3 and timing.take_gaps() == []


def test_a_job_report_splits_the_host_time_between_dispatches_by_phase_and_counts_gc_passes(tmp_path,
                                                                                              tiny_model_dir):
    """On CPU the async engine (forced on) marks every step: the report's spans count the dispatched steps; no
    gaps (no CUDA events)."""
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(9))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    engine={"async_pipeline": True, "max_num_seqs": 4}, sampling={"max_new_tokens": 6})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "reports" / "w00000.json").read_text())
    trace, steps = report["idle_gaps"], report["engine"]["num_steps"]
    assert 0 < trace["num_spans"] <= steps - 1
    assert set(trace["host_ms_per_span"]) == set(PHASES) and min(trace["host_ms_per_span"].values()) >= 0
    assert trace["num_gaps_over_1ms"] == 0 and trace["longest_gaps"] == []
    # the loop's GC passes by generation (the set-up's collect-and-freeze not counted): young passes always run
    passes = report["gc_passes"]
    assert passes["0"]["num"] > 0 and all(p["max_ms"] >= 0 for p in passes.values())
    assert sum(p["num"] for p in passes.values()) > 0 and set(passes) <= {"0", "1", "2"}

"""Throughput: a meter that writes a JSONL log every few seconds, and the tqdm progress bar."""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm


@dataclass
class Totals:
    rows_done: int = 0  # input rows finished (generated or rejected), committed or not
    rows_committed: int = 0
    rows_rejected: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    step_s: float = 0.0  # time in engine steps (prepare + forward + sample)
    # Where the rest of the loop's time goes, so a host-bound run shows which part grows:
    admit_s: float = 0.0  # reading, rendering and tokenizing rows, and adding them to the engine
    commit_s: float = 0.0  # writing and fsyncing shards, manifest lines
    gc_s: float = 0.0  # Python's cyclic garbage collector, wherever it ran (see GcTimer)
    # per generation ("0", "1", "2"): passes and the longest one's seconds (a full pass over many live requests
    # is one long host stall; many young passes are not)
    gc_passes: dict[str, int] = field(default_factory=dict)
    gc_max_s: dict[str, float] = field(default_factory=dict)
    # Triton kernels specialised during the loop (see CompileTimer): a shape the engine's warm-up never reached
    # compiles (or loads from Triton's disk cache) on the host in the middle of the run, the GPU waiting
    compile_s: float = 0.0
    compiled_kernels: dict[str, int] = field(default_factory=dict)  # kernel name -> specialisations built
    # the first MAX_BUILDS builds, in order: {"kernel", "s", "spec"}; spec names the specialisation (warps, stages,
    # each argument's type with "D" where Triton assumed it divisible by 16, constexprs and ints specialised to 1
    # as "name=value"), so a report shows which argument or launch made a kernel build again mid-run
    builds: list[dict] = field(default_factory=list)
    builds_dropped: int = 0  # builds past MAX_BUILDS (timed and counted above, not listed)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    rejects_by_class: dict[str, int] = field(default_factory=dict)


def peak_rss_mib() -> float:
    """This process's peak resident memory so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """This process's resident memory now (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return 0.0


class GcTimer:
    """Adds the time of every garbage-collector pass to `totals.gc_s` while installed (gc.callbacks is
    process-wide state: installed by the meter, removed by its close)."""

    def __init__(self, totals: Totals) -> None:
        self.totals = totals
        self._started = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            t, s = self.totals, time.perf_counter() - self._started
            gen = str(info.get("generation"))
            t.gc_s += s
            t.gc_passes[gen] = t.gc_passes.get(gen, 0) + 1
            t.gc_max_s[gen] = max(t.gc_max_s.get(gen, 0.0), s)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


MAX_BUILDS = 64


def build_spec(compile_info: dict) -> str:
    """A Triton build's specialisation in words, from the `compile` keyword of its runtime hooks (signature: name
    -> type, "constexpr" for constexprs and ints equal to 1; constants: (index,) -> value; configs[0]: (index,) ->
    attributes, "tt.divisibility" 16 where an int or pointer was divisible by 16)."""
    sig = compile_info.get("signature") or {}
    constants = compile_info.get("constants") or {}
    attrs = (compile_info.get("configs") or [{}])[0] or {}
    divisible = {path for path, values in attrs.items() if any(v[0] == "tt.divisibility" for v in values)}
    args = [f"{name}={constants.get((i,), '?')}" if ty == "constexpr" else
            f"{name}: {ty}{'D' if (i,) in divisible else ''}" for i, (name, ty) in enumerate(sig.items())]
    return f"warps {compile_info.get('num_warps')}, stages {compile_info.get('num_stages')}: {', '.join(args)}"


class CompileTimer:
    """Adds the time of every Triton JIT build (a compile, or a load from Triton's disk cache) to
    `totals.compile_s`, counted per kernel in `totals.compiled_kernels`, while installed. Triton's two runtime
    hooks (knobs.runtime.jit_cache_hook before a build, jit_post_compile_hook after it) are process-wide single
    slots: installed by the meter, the previous hooks kept and called, and put back by remove()."""

    def __init__(self, totals: Totals) -> None:
        self.totals = totals
        self._started: dict[object, float] = {}
        try:
            from triton import knobs
        except ImportError:  # installs without Triton build no kernels
            self._runtime = None
            return
        self._runtime = knobs.runtime
        self._prev = (self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook)
        self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._before, self._after

    @staticmethod
    def _build(kwargs: dict) -> tuple:
        fn = kwargs.get("fn")  # triton's JitFunctionInfo(module, name, jit_function)
        return getattr(fn, "module", None), getattr(fn, "name", "?"), kwargs.get("key")

    def _before(self, *args, **kwargs):
        if self._runtime is not None:  # removed timers still in the chain (removed out of order) only forward
            self._started[self._build(kwargs)] = time.perf_counter()
        prev = self._prev[0]
        return prev(*args, **kwargs) if prev else None  # a true answer skips the build: the previous hook's call

    def _after(self, *args, **kwargs):
        build = self._build(kwargs)
        started = self._started.pop(build, None)
        if started is not None:
            seconds = time.perf_counter() - started
            self.totals.compile_s += seconds
            self.totals.compiled_kernels[build[1]] = self.totals.compiled_kernels.get(build[1], 0) + 1
            if len(self.totals.builds) < MAX_BUILDS:
                self.totals.builds.append({"kernel": build[1], "s": round(seconds, 4),
                                           "spec": build_spec(kwargs.get("compile") or {})})
            else:
                self.totals.builds_dropped += 1
        prev = self._prev[1]
        return prev(*args, **kwargs) if prev else None

    def remove(self) -> None:
        """Stop counting; put the previous hooks back where this timer's are still the installed ones (a timer
        installed later stays installed, and calls through this one, which then only forwards)."""
        if self._runtime is not None and self._runtime.jit_cache_hook == self._before:
            prev = self._prev
            while isinstance(owner := getattr(prev[0], "__self__", None), CompileTimer) and owner._runtime is None:
                prev = owner._prev  # skip timers removed out of order: nothing calls through them any more
            self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = prev
        self._runtime = None
        self._started.clear()


class ThroughputMeter:
    def __init__(self, log_path: Path, expected_rows: int | None, interval_s: float = 5.0,
                 show_progress: bool = True) -> None:
        """`expected_rows`: this worker's rows (the bar's total, None if unknown)."""
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.interval_s = interval_s
        self.totals = Totals()
        self._gc_timer = GcTimer(self.totals)
        self._compile_timer = CompileTimer(self.totals)
        self.start = time.monotonic()
        self._last_t = self.start
        self._last_gen = 0
        self._last_rows = 0
        self._bar = tqdm(total=expected_rows, unit="row", dynamic_ncols=True, disable=not show_progress,
                         smoothing=0.05)

    def row_skipped(self) -> None:
        """A row an earlier run committed: the bar counts it (a resumed bar ends at its total); rates do not."""
        self._bar.update(1)

    def row_finished(self, num_generated: int) -> None:
        self._bar.update(1)
        self._bar.set_postfix_str(f"{self.totals.generated_tokens / max(self.elapsed_s, 1e-9):.0f} tok/s",
                                  refresh=False)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def maybe_log(self, engine_stats: Callable[[], dict[str, Any]], force: bool = False) -> None:
        """Append a record every interval_s (or now, with force); `engine_stats` is called only then (the loop
        asks every step)."""
        now = time.monotonic()
        if not force and now - self._last_t < self.interval_s:
            return
        t = self.totals
        window = max(now - self._last_t, 1e-9)
        record = {
            "time": time.time(), "elapsed_s": round(now - self.start, 3),
            "rows_done": t.rows_done, "rows_committed": t.rows_committed, "rows_rejected": t.rows_rejected,
            "prompt_tokens": t.prompt_tokens, "generated_tokens": t.generated_tokens,
            "cached_tokens": t.cached_tokens,
            "gen_tok_s_window": round((t.generated_tokens - self._last_gen) / window, 2),
            "gen_tok_s_overall": round(t.generated_tokens / max(now - self.start, 1e-9), 2),
            "rows_s_window": round((t.rows_done - self._last_rows) / window, 3),
            "step_s": round(t.step_s, 3), "admit_s": round(t.admit_s, 3), "commit_s": round(t.commit_s, 3),
            "gc_s": round(t.gc_s, 3), "compile_s": round(t.compile_s, 3), "rss_mib": round(rss_mib(), 1),
            **engine_stats(),
        }
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self._last_t, self._last_gen, self._last_rows = now, t.generated_tokens, t.rows_done

    def close(self) -> None:
        self._gc_timer.remove()
        self._compile_timer.remove()
        self._bar.close()

"""One timed `batchgen run` of the job bench (bench/job.py) and its record: tok/s end to end, steady and in
windows of the rows, ms a step and the host's share, the device's busy and idle shares by kind of step, Triton
builds in the loop, and the run's limit; then the A/B summary over such records.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from batchgen.bench.ab import ratio, variant_means
from batchgen.bench.geometries import decode_bytes
from batchgen.bench.seed import Ceilings
from batchgen.quant.scheme import is_fp8


def run_limit_s(outputs: list[dict], config, num_steps: int, c: Ceilings, kv_element_bytes: int = 2) -> float:
    """The run's limit: each step's GEMMs (FLOPs at the matmul rate, or weight bytes at bandwidth, whichever is
    longer; MoE: every expert's bytes, an upper bound until the run's routing is counted), every generated
    token's K/V reads at bandwidth (sliding layers: their window), prefill FLOPs at the matmul rate (prompt tokens
    skip the LM head; every generated token pays it above). An FP8
    checkpoint's projections count one byte a weight and their FLOPs run at the FP8 rate measured in the run.
    kv_element_bytes: 1 for a run with engine.kv_cache_dtype fp8."""
    b = decode_bytes(config, kv_element_bytes=kv_element_bytes)
    top_k = getattr(config.get_text_config(), "num_experts_per_tok", 0) or 0
    generated = sum(o["num_completion_tokens"] for o in outputs)
    prompt = sum(o["num_prompt_tokens"] for o in outputs)
    gemm_s = max(b.gemm_s(generated, top_k, c), num_steps * b.weight_bytes() / c.copy_bytes_s)
    kv_bytes = sum(b.kv_bytes_decoding(o["num_prompt_tokens"], o["num_completion_tokens"]) for o in outputs)
    return gemm_s + kv_bytes / c.copy_bytes_s + b.gemm_s(prompt, top_k, c, head=False)


def window_tok_s(log_path: Path, rows: int, lo: float, hi: float) -> float | None:
    """Engine tokens per second between fractions lo and hi of the rows done, from the run's throughput log (a
    record every ~5 s: None when fewer than two records fall in the window, or when they carry one time: the
    final record of a short run can repeat the last periodic one's rounded elapsed_s)."""
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    mid = [r for r in records if lo * rows <= r["rows_done"] <= hi * rows]
    if len(mid) < 2 or mid[-1]["elapsed_s"] <= mid[0]["elapsed_s"]:
        return None
    field = "num_generated_tokens" if "num_generated_tokens" in mid[0] else "generated_tokens"  # older logs
    return (mid[-1][field] - mid[0][field]) / (mid[-1]["elapsed_s"] - mid[0]["elapsed_s"])


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def steady_tok_s(log_path: Path, rows: int) -> float | None:
    """Engine tokens per second between 10 % and 90 % of the rows done."""
    return window_tok_s(log_path, rows, 0.1, 0.9)


def run_job(job: Path, out_dir: Path, max_num_seqs: int | str, penalty: float, rows: int, config, c: Ceilings,
            batchgen_dir: str | None = None, extra_sets: list[str] = (), run_args: list[str] = ()) -> dict:
    """One `batchgen run` of the job, by this batchgen or, for an A/B, the one in `batchgen_dir` (a checkout),
    and its record. max_num_seqs "auto": no engine.max_num_seqs set (the job's default); the record gives the
    engine's choice. run_args: more `batchgen run` options (e.g. --ray --workers 1); the report read is worker
    0's, so they must give one worker."""
    import pyarrow.parquet as pq

    process_s = _run_process(job, out_dir, max_num_seqs, penalty, batchgen_dir, extra_sets, run_args)
    report = json.loads((out_dir / "reports" / "w00000.json").read_text())
    outputs = pq.read_table(glob.glob(str(out_dir / "data" / "*.parquet")),
                            columns=["num_prompt_tokens", "num_completion_tokens"]).to_pylist()
    e = report["engine"]
    sets = dict(kv.split("=", 1) for kv in extra_sets)
    kv_bytes = 1 if sets.get("engine.kv_cache_dtype") == "fp8" else 2
    limit = run_limit_s(outputs, config, e["num_steps"], c, kv_element_bytes=kv_bytes)
    fp8 = is_fp8(config)  # FP8 projections: their rate's sustained figure is not measured
    return {
        "code": batchgen_dir or "this", "max_num_seqs": max_num_seqs, "repetition_penalty": penalty,
        # what the engine ran (auto: its choice); None: a checkout whose report does not say
        "engine_max_num_seqs": e.get("max_num_seqs"), "engine_max_num_batched_tokens": e.get("max_num_batched_tokens"),
        "rows": len(outputs),
        **_throughput(report, out_dir / "logs" / "throughput-w00000.jsonl", rows, process_s),
        **_step_costs(report), **_triton_builds(report),
        "limit_s": round(limit, 2), "limit_tok_s": round(report["generated_tokens"] / limit, 1),
        "x_limit": round(report["wall_s"] / limit, 2),
        # the same limit with bf16 GEMM FLOPs at the sustained matmul rate (what the GPU holds at its power limit)
        "x_limit_sustained": None if not c.matmul_sustained_flop_s or fp8 else round(report["wall_s"] / run_limit_s(
            outputs, config, e["num_steps"], replace(c, matmul_flop_s=c.matmul_sustained_flop_s), kv_bytes), 2),
    }


def _run_process(job: Path, out_dir: Path, max_num_seqs: int | str, penalty: float, batchgen_dir: str | None,
                 extra_sets: list[str], run_args: list[str] = ()) -> float:
    """Run `batchgen run` in a subprocess (the other checkout's from its own folder: `python -m` puts the working
    folder first on sys.path); its wall seconds."""
    env = dict(os.environ)
    if batchgen_dir:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(batchgen_dir).resolve()), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "batchgen.cli", "run", str(job), "-o", str(out_dir), "--fresh", "--no-progress",
           *(["--set", f"engine.max_num_seqs={max_num_seqs}"] if max_num_seqs != "auto" else []),
           "--set", f"sampling.repetition_penalty={penalty}",
           *[arg for kv in extra_sets for arg in ("--set", kv)], *run_args]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=batchgen_dir or None)
    return time.perf_counter() - t0


def _throughput(report: dict, log_path: Path, rows: int, process_s: float) -> dict:
    """A run's tokens, times and tok/s: end to end over the loop, steady (10-90 % of the rows), and in windows."""
    tokens = report["generated_tokens"]
    return {
        "generated_tokens": tokens, "process_s": round(process_s, 2), "setup_s": report["setup_s"],
        "loop_s": report["wall_s"], "tok_s_end_to_end": round(tokens / report["wall_s"], 1),
        "tok_s_steady": round(steady_tok_s(log_path, rows) or 0.0, 1),
        # host growth over a long run: the middle tenth of the rows against the last tenth (which holds the final
        # drain, when no rows wait and the batch empties) and the tenth before it
        # (None: fewer than two ~5 s log records in the window, a short run)
        **{f"tok_s_rows_{int(100 * lo)}_{int(100 * hi)}": _rounded(window_tok_s(log_path, rows, lo, hi))
           for lo, hi in ((0.45, 0.55), (0.8, 0.9), (0.9, 1.0))},
    }


def _step_costs(report: dict) -> dict:
    """A run's steps: tokens and ms a step, the host's share, how busy the device was, by kind of step."""
    e, steps, wall_s = report["engine"], report["engine"]["num_steps"], report["wall_s"]
    return {
        "steps": steps, "tokens_per_step": round(report["generated_tokens"] / steps, 1),
        "loop_ms_per_step": round(1e3 * wall_s / steps, 2),
        "engine_step_ms": round(1e3 * report["loop_s"]["step"] / steps, 2),
        "host_ms_per_step": round(1e3 * (e["schedule_cpu_s"] + e["prepare_cpu_s"]) / steps, 2),
        # device time of the steps over the loop's wall time: below 1, the device waited for the host
        "gpu_busy": round(e.get("gpu_busy_s", 0.0) / wall_s, 3),
        # where the loop's wall time went on the device, by kind of step: GPU ms a step of each kind, and the
        # shares of the wall time the device was busy with decode / mixed steps or idle before them
        **step_kinds(e, wall_s),
        # the job loop's seconds: engine steps, rendering / queueing rows, commits, Python's GC, Triton builds
        "loop_breakdown_s": report["loop_s"],
        "gc_passes": report.get("gc_passes"),  # per generation: passes and the longest's ms
        # the host's ms a step by phase, over all steps and before the device's gaps over 1 ms (job/idle_trace.py;
        # None: a checkout whose report does not say)
        "idle_gaps": report.get("idle_gaps"),
    }


def _triton_builds(report: dict) -> dict:
    """Triton builds in the run's loop (what makes a first timed run slow): seconds, kernels specialised, and
    each loop build's specialisation (Triton's description: which argument or launch made it build again)."""
    return {
        "triton_compile_s": report["loop_s"].get("triton_compile", 0.0),
        "triton_kernels_compiled": report.get("triton_kernels_compiled", {}),
        "engine_setup_triton_compile_s": report.get("engine_setup_triton_compile_s", 0.0),
        "triton_loop_builds": report.get("triton_builds", {}).get("loop", []),
    }


def step_kinds(engine_stats: dict, wall_s: float) -> dict:
    """Per kind of step (runner/step_timing.py): how many, GPU ms each, and the shares of the loop's wall time
    the device spent busy with them and idle before them (empty for reports without these counters)."""
    if "num_decode_steps" not in engine_stats:
        return {}
    out = {"num_prefill_tokens": engine_stats["num_prefill_tokens"],
           # a few long stalls or many short gaps (runs before these counters: None)
           "gpu_idle_max_ms": round(1e3 * engine_stats["gpu_idle_max_s"], 2) if "gpu_idle_max_s" in engine_stats
           else None, "num_gpu_idle_over_1ms": engine_stats.get("num_gpu_idle_over_1ms")}
    for kind in ("decode", "mixed"):
        n, busy = engine_stats[f"num_{kind}_steps"], engine_stats[f"gpu_busy_s_{kind}"]
        out[f"num_{kind}_steps"] = n
        out[f"gpu_ms_per_{kind}_step"] = round(1e3 * busy / n, 3) if n else None
        out[f"share_busy_{kind}"] = round(busy / wall_s, 4)
        out[f"share_idle_before_{kind}"] = round(engine_stats[f"gpu_idle_s_before_{kind}"] / wall_s, 4)
    return out


def ab_summary(runs: list[dict]) -> list[dict]:
    """Per (max_num_seqs, penalty): the mean end-to-end tok/s of the A runs and of the B runs, and B/A (A and B:
    without and with the --ab-set sets, or the --compare checkout and this one); the same over the runs without
    Triton builds in their loop (batchgen/bench/ab.py: a cold run says nothing about its variant)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["max_num_seqs"], r["repetition_penalty"]), []).append(r)
    out = []
    for (seqs, penalty), mine in groups.items():
        m = variant_means(mine, "tok_s_end_to_end")
        out.append({"max_num_seqs": seqs, "repetition_penalty": penalty, "A_tok_s": _rounded(m["A"]),
                    "B_tok_s": _rounded(m["B"]), "B_over_A": ratio(m["B"], m["A"]),
                    "B_over_A_warm": ratio(m["B_warm"], m["A_warm"]), "num_cold_runs": m["num_cold_runs"]})
    return out

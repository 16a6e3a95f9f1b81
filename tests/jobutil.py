"""Helpers for job tests: a tiny model saved with a tokenizer, job files, reading outputs."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from conftest import make_model, make_tokenizer

REPO = Path(__file__).resolve().parent.parent
TOPICS = ["the sea", "bread", "rome", "bees", "jazz", "stars", "maps", "tea", "rain", "clocks", "owls", "salt"]


def save_tiny_model(root: Path) -> str:
    """A tiny random Llama with our test tokenizer, saved like any transformers checkpoint."""
    path = root / "tiny-llama"
    tok = make_tokenizer()
    model = make_model("llama", vocab_size=len(tok), max_position_embeddings=256)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def seed_rows(n: int) -> list[dict]:
    return [{"id": f"row-{i:04d}", "topic": TOPICS[i % len(TOPICS)], "level": i % 3} for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_job(tmp: Path, model_path: str, source: dict, *, name: str = "job.yaml", **sections) -> Path:
    job = {
        "model": {"path": model_path, "device": "cpu"},
        "source": source,
        "prompt": {"template": "Write about {{ topic }} at level {{ level }}.", "chat": True},
        "sampling": {"max_new_tokens": 12, "temperature": 0.0, "seed": 3},
        "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "num_kv_blocks": 256, "block_size": 8},
        "output": {"dir": "out", "rows_per_shard": 5},
    }
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp / name
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def six_row_job(tmp: Path, model_path: str) -> Path:
    """The common job of the CLI tests: rows.jsonl of seed_rows(6), keyed by id."""
    write_jsonl(tmp / "rows.jsonl", seed_rows(6))
    return write_job(tmp, model_path, {"path": "rows.jsonl", "key_column": "id"})


def invoke_run(*args):
    """`batchgen run ARGS --no-progress` in this process (typer's CliRunner): its result."""
    from typer.testing import CliRunner

    from batchgen.cli import app

    return CliRunner().invoke(app, ["run", *map(str, args), "--no-progress"])


def read_rows(out_dir: Path, folder: str = "data") -> list[dict]:
    rows = []
    for f in sorted(glob.glob(str(out_dir / folder / "*.parquet"))):
        rows += pq.read_table(f).to_pylist()
    return rows


def content_once(out_dir: Path) -> list[dict]:
    """An output's sample rows in (id, sample_idx) order, asserting none was written twice; num_cached_tokens left
    out (it depends on which rows shared a batch)."""
    rows = read_rows(out_dir)
    keys = [(r["id"], r["sample_idx"]) for r in rows]
    assert len(keys) == len(set(keys)), "a row was written twice"
    return sorted(({k: v for k, v in r.items() if k != "num_cached_tokens"} for r in rows),
                  key=lambda r: (r["id"], r["sample_idx"]))


def run_here(job: Path, out: Path, overrides: tuple[str, ...] = ()):
    """`batchgen run JOB -o OUT --set ...` in this process: no interpreter to start and no imports to repeat (about
    5 s less than run_cli on 2 cores). For runs whose own process is not what a test is about: references, and
    resumes after a killed run. Returns the RunResult; a refused run raises its JobError."""
    from batchgen.job.job_file import load_spec
    from batchgen.job.run import run_job

    return run_job(load_spec(job, list(overrides), str(out)), show_progress=False)


def cli_here(*args: str) -> subprocess.CompletedProcess:
    """`batchgen ...` in this process (typer's CliRunner), as run_cli's result (returncode, stdout, stderr): for
    commands that only read (status, export) or are refused before they run anything."""
    from typer.testing import CliRunner

    from batchgen.cli import app

    argv = [*args, "--no-progress"] if args[0] == "run" else list(args)
    result = CliRunner().invoke(app, argv)
    return subprocess.CompletedProcess(argv, result.exit_code, result.stdout, result.stderr)


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`batchgen ...` as a separate process (what a user or a scheduler runs)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "batchgen.cli", *args, "--no-progress"] if args[0] == "run" else
                          [sys.executable, "-m", "batchgen.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO)

"""The recipes of the docs (docs/recipes/) run as shipped: each job file in jobs/examples/ with only its model
swapped for a tiny random one, a small engine, few new tokens and its output under tmp_path; its own data files
and every other key as the user gets them."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import yaml
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows

runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parents[2] / "jobs" / "examples"


def _recipe(tmp_path: Path, name: str, model_dir: str, *, upstream: Path | None = None, max_new_tokens=8) -> Path:
    job = yaml.safe_load((EXAMPLES / name).read_text())
    job["model"] = {"path": model_dir, "device": "cpu"}
    job["engine"] = {"max_num_seqs": 8, "num_kv_blocks": 256, "block_size": 8}
    job.setdefault("sampling", {})
    if max_new_tokens is not None:
        job["sampling"]["max_new_tokens"] = max_new_tokens
    job["output"]["dir"] = str(tmp_path / "out" / job["name"])
    job["output"]["report"] = False
    source = job["source"]["path"]
    job["source"]["path"] = str(upstream) if upstream is not None else str((EXAMPLES / source).resolve())
    path = tmp_path / name
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _run(path: Path, *args: str, env: dict | None = None) -> None:
    result = runner.invoke(app, ["run", str(path), "--no-progress", *args], env=env)
    assert result.exit_code == 0, result.output


def test_synthetic_instructions_then_a_judge_that_keeps_which_sample_it_rated(tmp_path, tiny_model_dir):
    first = _recipe(tmp_path, "synthetic_instructions.yaml", tiny_model_dir)
    _run(first)
    upstream_dir = tmp_path / "out" / "synthetic-instructions"
    candidates = {(r["id"], r["sample_idx"]): r["completion"] for r in read_rows(upstream_dir)}
    assert len(candidates) == 24  # 12 topics x n 2
    judge = _recipe(tmp_path, "judge.yaml", tiny_model_dir, upstream=upstream_dir)
    _run(judge)
    scores = read_rows(tmp_path / "out" / "judge")
    assert len(scores) == 24 and len({r["upstream_id"] for r in scores}) == 24
    for r in scores:
        assert (r["upstream_key"], r["upstream_sample_idx"]) in candidates
        assert r["upstream_id"] == f"{r['upstream_key']}#{r['upstream_sample_idx']}"
        assert r["completion"] in {"1", "2", "3", "4", "5"}  # the choice format: one digit, nothing else


def test_logprob_scoring_scores_every_prompt_token_without_generating(tmp_path, tiny_model_dir):
    _run(_recipe(tmp_path, "logprob_scoring.yaml", tiny_model_dir, max_new_tokens=None))
    rows = read_rows(tmp_path / "out" / "logprob-scoring")
    assert len(rows) == 48
    for r in rows:
        assert r["completion"] == "" and r["finish_reason"] == "length"
        lp = r["prompt_logprobs"]
        assert len(lp) == r["num_prompt_tokens"] and lp[0] is None and all(v <= 0 for v in lp[1:])


def test_structured_extraction_gives_json_that_parses_where_the_row_finished(tmp_path, tiny_model_dir):
    _run(_recipe(tmp_path, "extract_json.yaml", tiny_model_dir, max_new_tokens=32))
    rows = read_rows(tmp_path / "out" / "extract-json")
    assert len(rows) == 8
    for r in rows:
        if r["finish_reason"] == "stop":  # a random tiny model may be cut by max_new_tokens (length)
            value = json.loads(r["completion"])
            assert set(value) == {"customer", "product", "sentiment", "urgent"}


def test_openai_batch_in_and_out_every_custom_id_once(tmp_path, tiny_model_dir):
    _run(_recipe(tmp_path, "openai_batch.yaml", tiny_model_dir, max_new_tokens=None))
    out = tmp_path / "out" / "openai-batch"
    results, errors = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    exported = runner.invoke(app, ["export", str(out), "--format", "openai", "--to", str(results),
                                   "--errors", str(errors)])
    assert exported.exit_code == 0, exported.output
    ok = [json.loads(line) for line in results.read_text().splitlines()]
    bad = [json.loads(line) for line in errors.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in ok + bad) == [f"req-{i}" for i in range(1, 7)]
    assert [r["custom_id"] for r in bad] == ["req-6"]  # `tools` is not supported: rejected, not dropped
    assert bad[0]["error"]["code"] == "bad_sampling"
    by_id = {r["custom_id"]: r for r in ok}
    assert len(by_id["req-3"]["response"]["body"]["choices"]) == 2  # the line's n: 2


def test_the_cluster_job_as_two_slurm_array_tasks_writes_every_row_once(tmp_path, tiny_model_dir):
    path = _recipe(tmp_path, "cluster.yaml", tiny_model_dir)
    for task in ("0", "1"):
        _run(path, env={"SLURM_ARRAY_TASK_ID": task, "SLURM_ARRAY_TASK_COUNT": "2"})
    out = tmp_path / "out" / "cluster"
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == sorted(json.loads(x)["id"] for x in
                                                   (EXAMPLES.parent / "data" / "seed_topics.jsonl").read_text()
                                                   .splitlines())
    assert sorted(p.name for p in (out / "manifest").iterdir()) == ["w00000.jsonl", "w00001.jsonl"]
    for shard in (out / "data").glob("*.parquet"):
        assert pq.read_metadata(shard).num_rows > 0


def test_the_other_shipped_examples_run(tmp_path, tiny_model_dir):
    """parquet_source, hf_dataset and structured_json as shipped (the chained pair: tests/job/test_chained_jobs.py)."""
    for name in ("parquet_source.yaml", "hf_dataset.yaml", "structured_json.yaml"):
        path = _recipe(tmp_path, name, tiny_model_dir)
        _run(path)
        out = tmp_path / "out" / yaml.safe_load(path.read_text())["name"]
        assert read_rows(out), name

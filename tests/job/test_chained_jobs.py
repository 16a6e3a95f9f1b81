"""Chained jobs: an output directory is a source (committed completions only, in manifest order), and the
upstream's fingerprint is part of the downstream's. The shipped example pair runs on a tiny model."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows

runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parents[2] / "jobs" / "examples"


def _example(tmp_path: Path, name: str, model_dir: str, **changes) -> Path:
    """A shipped example job with the tiny model, a small engine, and paths under tmp_path."""
    job = yaml.safe_load((EXAMPLES / name).read_text())
    job["model"] = {"path": model_dir, "device": "cpu"}
    job["engine"] = {"max_num_seqs": 8, "num_kv_blocks": 256, "block_size": 8}
    job["sampling"]["max_new_tokens"] = 8
    job["output"]["dir"] = str(tmp_path / "out" / job["name"])
    job["output"]["report"] = False
    if name == "chain_questions.yaml":
        job["source"]["path"] = str(EXAMPLES.parent / "data" / "seed_topics.jsonl")
        job["source"]["limit"] = 10
    else:
        job["source"]["path"] = str(tmp_path / "out" / "chain-questions")
    for section, values in changes.items():
        job[section].update(values)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def test_the_example_pair_runs_the_second_job_over_the_firsts_completions_and_resumes(tmp_path, tiny_model_dir):
    first = _example(tmp_path, "chain_questions.yaml", tiny_model_dir)
    assert runner.invoke(app, ["run", str(first), "--no-progress"]).exit_code == 0
    questions = {r["id"]: r for r in read_rows(tmp_path / "out" / "chain-questions")}
    # a crash's leftover shard (no manifest names it: the commit after the last recorded one) is never read
    upstream = tmp_path / "out" / "chain-questions"
    num_commits = len((upstream / "manifest" / "w00000.jsonl").read_bytes().splitlines())
    (upstream / "data" / f"part-w00000-{num_commits:06d}.parquet").write_bytes(b"leftover")
    second = _example(tmp_path, "chain_answers.yaml", tiny_model_dir)
    result = runner.invoke(app, ["run", str(second), "--no-progress"])
    assert result.exit_code == 0, result.output
    answers = read_rows(tmp_path / "out" / "chain-answers")
    assert sorted(r["id"] for r in answers) == sorted(questions) and len(answers) == 10
    for r in answers:  # the upstream's columns came through: its topic, and its completion in the prompt
        assert r["topic"] == questions[r["id"]]["topic"]
        assert questions[r["id"]]["completion"] in r["prompt"]
    again = runner.invoke(app, ["run", str(second), "--no-progress"])
    assert again.exit_code == 0 and "10 already done" in again.output


def test_a_downstream_resume_after_the_upstream_changed_is_refused_naming_it(tmp_path, tiny_model_dir):
    first = _example(tmp_path, "chain_questions.yaml", tiny_model_dir)
    assert runner.invoke(app, ["run", str(first), "--no-progress"]).exit_code == 0
    second = _example(tmp_path, "chain_answers.yaml", tiny_model_dir)
    assert runner.invoke(app, ["run", str(second), "--no-progress"]).exit_code == 0
    changed = _example(tmp_path, "chain_questions.yaml", tiny_model_dir, sampling={"temperature": 1.2})
    assert runner.invoke(app, ["run", str(changed), "--no-progress", "--fresh"]).exit_code == 0
    result = runner.invoke(app, ["run", str(second), "--no-progress"])
    assert result.exit_code == 2 and "upstream" in result.output


def test_an_output_directory_without_committed_rows_is_a_clear_error(tmp_path, tiny_model_dir):
    (tmp_path / "out" / "chain-questions" / "manifest").mkdir(parents=True)
    (tmp_path / "out" / "chain-questions" / "data").mkdir()
    second = _example(tmp_path, "chain_answers.yaml", tiny_model_dir)
    result = runner.invoke(app, ["run", str(second), "--no-progress"])
    assert result.exit_code == 2 and "no committed completions yet" in result.output


def test_a_judge_over_an_upstream_with_n_2_keeps_which_sample_it_read(tmp_path, tiny_model_dir):
    """Lineage: keyed by upstream_id (unique per upstream sample), the downstream keeps upstream_key and
    upstream_sample_idx, and each of its rows joins back to the exact upstream completion it judged."""
    first = _example(tmp_path, "chain_questions.yaml", tiny_model_dir, sampling={"n": 2, "temperature": 0.9})
    assert runner.invoke(app, ["run", str(first), "--no-progress"]).exit_code == 0
    upstream = {(r["id"], r["sample_idx"]): r["completion"] for r in read_rows(tmp_path / "out" / "chain-questions")}
    assert len(upstream) == 20
    second = _example(tmp_path, "chain_answers.yaml", tiny_model_dir,
                      source={"key_column": "upstream_id"},
                      output={"keep_columns": ["upstream_key", "upstream_sample_idx"], "keep_prompt": True})
    result = runner.invoke(app, ["run", str(second), "--no-progress"])
    assert result.exit_code == 0, result.output
    judged = read_rows(tmp_path / "out" / "chain-answers")
    assert len(judged) == 20 and len({r["upstream_id"] for r in judged}) == 20
    for r in judged:
        assert r["upstream_id"] == f"{r['upstream_key']}#{r['upstream_sample_idx']}" and r["sample_idx"] == 0
        assert upstream[(r["upstream_key"], r["upstream_sample_idx"])] in r["prompt"]


def test_a_position_keyed_downstream_resumes_as_the_upstream_grows_and_is_refused_once_its_rows_moved(
        tmp_path, tiny_model_dir):
    """Positions stand for upstream rows only while the upstream's records grow at the end. After the upstream is
    repaired and run again (a damaged shard's rows committed anew, last), position P is another row: the resume is
    refused by run and validate, instead of answering some rows twice and others never."""
    def upstream(limit):
        return _example(tmp_path, "chain_questions.yaml", tiny_model_dir, source={"limit": limit},
                        output={"rows_per_shard": 2})

    up = tmp_path / "out" / "chain-questions"
    assert runner.invoke(app, ["run", str(upstream(6)), "--no-progress"]).exit_code == 0
    down = _example(tmp_path, "chain_answers.yaml", tiny_model_dir, source={"key_column": None},
                    output={"keep_columns": ["upstream_id"], "rows_per_shard": 2})
    assert runner.invoke(app, ["run", str(down), "--no-progress"]).exit_code == 0
    assert runner.invoke(app, ["run", str(upstream(10)), "--no-progress"]).exit_code == 0  # it grows at the end
    grown = runner.invoke(app, ["run", str(down), "--no-progress"])
    assert grown.exit_code == 0 and "6 already done" in grown.output, grown.output
    answered = sorted(r["upstream_id"] for r in read_rows(tmp_path / "out" / "chain-answers"))
    assert answered == sorted(f"{r['id']}#0" for r in read_rows(up))  # each upstream row once
    first = sorted((up / "data").glob("*.parquet"))[0]
    first.write_bytes(first.read_bytes()[:100])  # damaged: repaired, its rows generated again and committed last
    assert runner.invoke(app, ["repair", str(up)]).exit_code == 0
    assert runner.invoke(app, ["run", str(upstream(10)), "--no-progress"]).exit_code == 0
    for command in ("validate", "run"):
        refused = runner.invoke(app, [command, str(down), *(["--no-progress"] if command == "run" else [])])
        assert refused.exit_code == 2 and "the upstream's committed rows moved" in refused.output, refused.output
        assert "source.key_column: upstream_id" in refused.output
    again = runner.invoke(app, ["run", str(down), "--no-progress", "--fresh"])
    assert again.exit_code == 0, again.output
    answered = sorted(r["upstream_id"] for r in read_rows(tmp_path / "out" / "chain-answers"))
    assert answered == sorted(f"{r['id']}#0" for r in read_rows(up))

"""engine.deterministic in a job: an uninterrupted run and one killed (kill -9) and resumed at another max_num_seqs
write the same completion token ids for every row; the fingerprint records the mode, so a resume may not switch it.

Rows keep their token ids and log-probs (sampling.logprobs 0). In the default mode the batch-dependent CPU GEMMs
change the last bits of the logits (tests/engine/test_deterministic_engine.py says what was measured), which shows in
the log-probs while this sharp tiny model seldom flips a token: the same kill and resume in the default mode is
asserted to differ there, so the deterministic case cannot pass vacuously."""

from __future__ import annotations

import json
import signal

import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows, run_cli, seed_rows, write_job, write_jsonl

NUM_ROWS = 10
runner = CliRunner()


def _job(tmp_path, model_dir, name: str = "job.yaml"):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(NUM_ROWS))
    return write_job(tmp_path, model_dir, {"path": "rows.jsonl", "key_column": "id"}, name=name,
                     sampling={"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 8, "ignore_eos": True,
                               "logprobs": 0},
                     engine={"max_num_seqs": 8, "max_num_batched_tokens": 64},
                     output={"rows_per_shard": 3, "keep_token_ids": True})


def _samples(out_dir) -> dict[str, tuple[list[int], list[float]]]:
    """row id -> (completion token ids, their log-probs)."""
    rows = read_rows(out_dir)
    assert len(rows) == NUM_ROWS and len({r["id"] for r in rows}) == NUM_ROWS  # exactly once
    return {r["id"]: (r["completion_token_ids"], r["completion_logprobs"]) for r in rows}


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_a_killed_and_resumed_run_at_another_batch_size_writes_the_same_tokens(tmp_path, tiny_model_dir,
                                                                              deterministic):
    job = _job(tmp_path, tiny_model_dir)
    mode = [f"--set=engine.deterministic={str(deterministic).lower()}"]
    done = runner.invoke(app, ["run", str(job), "--no-progress", "-o", str(tmp_path / "ref"), *mode])
    assert done.exit_code == 0, done.output
    assert ("deterministic: batch-invariant" in done.output) is deterministic  # the start-up line says so
    out = tmp_path / "killed"
    other = [*mode, "--set", "engine.max_num_seqs=3", "--set", "engine.max_num_batched_tokens=24"]
    crashed = run_cli("run", str(job), "-o", str(out), *other, env={"BATCHGEN_FAULT": "commit_done:2"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert 0 < len(read_rows(out)) < NUM_ROWS
    resumed = runner.invoke(app, ["run", str(job), "--no-progress", "-o", str(out), *other])
    assert resumed.exit_code == 0, resumed.output
    same = _samples(tmp_path / "ref") == _samples(out)
    assert same is deterministic, "the default mode no longer differs here: pick other shapes" if same else ""


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_two_workers_write_the_tokens_one_worker_writes(tmp_path, tiny_model_dir, deterministic):
    """The CPU stand-in for `--gpus 1` vs `--gpus 2`: each worker batches only its part of the rows."""
    job = _job(tmp_path, tiny_model_dir)
    mode = [f"--set=engine.deterministic={str(deterministic).lower()}", "--set", "source.worker_unit_rows=2"]
    one = run_cli("run", str(job), "-o", str(tmp_path / "one"), *mode)
    assert one.returncode == 0, one.stderr
    two = run_cli("run", str(job), "-o", str(tmp_path / "two"), "--workers", "2", *mode)
    assert two.returncode == 0 and "all 2 workers done" in two.stderr, two.stderr
    same = _samples(tmp_path / "one") == _samples(tmp_path / "two")
    assert same is deterministic, "the default mode no longer differs here: pick other shapes" if same else ""


def test_a_resume_may_not_switch_deterministic_mode_on_or_off(tmp_path, tiny_model_dir):
    from batchgen.output.fingerprint import FILE, refusal

    job = _job(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    first = runner.invoke(app, ["run", str(job), "--no-progress", "-o", str(out), "--deterministic",
                                "--set", "source.limit=2", "--set", "sampling.max_new_tokens=2"])
    assert first.exit_code == 0, first.output
    switched = runner.invoke(app, ["run", str(job), "--no-progress", "-o", str(out)])
    assert switched.exit_code == 2 and "engine.deterministic: True -> False" in switched.output
    # an output begun before the mode existed (no "engine" component) was made in the default mode
    stored = json.loads((out / FILE).read_text())
    components = dict(stored["components"])
    old = {k: v for k, v in components.items() if k != "engine"}
    (out / FILE).write_text(json.dumps({**stored, "components": old}))
    assert refusal(out, {**components, "engine": {"deterministic": False}}) is None
    assert "engine.deterministic: False -> True" in refusal(out, components)


def test_a_model_without_batch_invariant_layers_is_refused_before_its_weights_load(tmp_path):
    from conftest import make_model, make_tokenizer

    path = tmp_path / "tiny-moe"
    make_model("qwen3_moe", vocab_size=len(make_tokenizer())).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    (path / "model.safetensors").write_bytes(b"not weights: the refusal must come first")
    job = _job(tmp_path, str(path))
    for command in ("run", "validate"):
        result = runner.invoke(app, [command, str(job), "--set", "engine.deterministic=true"])
        assert result.exit_code == 2, result.output
        assert "engine.deterministic: batch-invariant mixture-of-experts layers" in result.output


def test_a_deterministic_resume_on_another_stack_warns_naming_what_differs(tmp_path, tiny_model_dir):
    from batchgen.output.numerics import FILE

    job = _job(tmp_path, tiny_model_dir)
    out, plain = tmp_path / "out", tmp_path / "plain"

    def run(out_dir, rows: int, *mode):  # each run has rows left to generate: the engine (and the check) runs
        result = runner.invoke(app, ["run", str(job), "-o", str(out_dir), "--no-progress", *mode, "--set",
                                     f"source.limit={rows}", "--set", "sampling.max_new_tokens=2"])
        assert result.exit_code == 0, result.output
        return result.output

    run(out, 1, "--deterministic")
    recorded = json.loads((out / FILE).read_text())
    assert recorded["device"].startswith("cpu") and recorded["torch"] and recorded["cpu_threads"]
    assert "another device or software stack" not in run(out, 2, "--deterministic")
    (out / FILE).write_text(json.dumps({**recorded, "torch": "1.0.0", "device": "NVIDIA H200, 132 SMs"}))
    moved = run(out, 3, "--deterministic")
    assert "another device or software stack" in moved
    assert "torch: '1.0.0' ->" in moved and "device: 'NVIDIA H200, 132 SMs' ->" in moved
    run(plain, 1)
    assert not (plain / FILE).exists()  # the default mode records nothing


def test_the_numerics_record_is_written_whole_once_and_a_damaged_one_warns(tmp_path):
    from batchgen.output.numerics import FILE, record_or_compare

    stack = {"device": "cpu: x86_64, AVX512", "torch": "2.13"}
    assert record_or_compare(tmp_path, stack) is None  # first: recorded
    assert record_or_compare(tmp_path, {**stack, "torch": "2.14"}) is not None  # another worker, another stack
    assert json.loads((tmp_path / FILE).read_text()) == stack  # the first record stays, no temporary file left
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE]
    for damaged in ("", "null", "[1]", "{"):
        (tmp_path / FILE).write_text(damaged)
        assert "cannot be read" in record_or_compare(tmp_path, stack)

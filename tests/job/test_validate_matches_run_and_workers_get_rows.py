"""`validate` refuses what `run` would refuse (keep_columns, duplicate or null keys, a fingerprint change), prints
resolved paths and counts a JSONL source's rows; `--version`; the `output:` section is optional; a failed start
leaves no lock-only folder behind; every worker of a small job gets rows, and one without rows says why."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

import batchgen
from batchgen.cli import app
from batchgen.job.job_file import load_spec
from batchgen.job.workers import DEFAULT_UNIT_ROWS, WorkerInfo, auto_unit_rows
from jobutil import read_rows, seed_rows, write_job, write_jsonl

runner = CliRunner()


def _cli(*args):
    return runner.invoke(app, [*map(str, args)])


def _job(tmp_path, model, rows=6, with_output=True, job_name=None, **sections):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(rows))
    job = write_job(tmp_path, model, {"path": "rows.jsonl", "key_column": "id"}, **sections)
    raw = yaml.safe_load(job.read_text())
    if not with_output:
        del raw["output"]
    if job_name is not None:
        raw["name"] = job_name
    job.write_text(yaml.safe_dump(raw))
    return job


def test_version_flag_prints_batchgen_version():
    result = _cli("--version")
    assert result.exit_code == 0 and result.output.strip() == f"batchgen {batchgen.__version__}"


def test_without_an_output_section_the_output_is_out_name_next_to_the_job_file(tmp_path, tiny_model_dir,
                                                                              monkeypatch):
    job = _job(tmp_path, tiny_model_dir, with_output=False, job_name="demo")
    result = _cli("validate", job)
    assert result.exit_code == 0, result.output
    assert f"output -> {tmp_path / 'out' / 'demo'}" in result.output
    job.write_text(job.read_text().replace("name: demo\n", ""))
    assert load_spec(job).output.dir == str(tmp_path / "out" / "job")  # no name: the job file's stem
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert load_spec(job, output_dir="here").output.dir == str(tmp_path / "cwd" / "here")  # -o: current folder


def test_validate_prints_normalised_paths(tmp_path, tiny_model_dir):
    (tmp_path / "jobs").mkdir()
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    job = write_job(tmp_path / "jobs", tiny_model_dir, {"path": "../rows.jsonl"}, output={"dir": "../out/x"})
    result = _cli("validate", job)
    assert result.exit_code == 0, result.output
    assert f"output -> {tmp_path / 'out' / 'x'}" in result.output and f"({tmp_path / 'rows.jsonl'})" in result.output
    assert "/../" not in result.output


def test_validate_refuses_keep_columns_that_are_not_in_the_source(tmp_path, tiny_model_dir):
    result = _cli("validate", _job(tmp_path, tiny_model_dir, output={"keep_columns": ["nope"]}))
    assert result.exit_code == 2
    assert "output.keep_columns names nope, not column(s) of the source; columns: id, topic, level" in result.output


@pytest.mark.parametrize("bad_key,message", [
    ("row-1001", "source.key_column 'id' has the duplicate key 'row-1001' (rows 1001 and 1003)"),
    (None, "source.key_column 'id' is null at row 1003"),
])
def test_validate_scans_every_key_as_run_does(tmp_path, tiny_model_dir, bad_key, message):
    job = _job(tmp_path, tiny_model_dir)
    rows = seed_rows(1500)  # the bad key lies past the 1,000 rows the prompt audit samples
    rows[1003]["id"] = bad_key
    write_jsonl(tmp_path / "rows.jsonl", rows)
    result = _cli("validate", job)
    assert result.exit_code == 2 and message in result.output


def test_validate_and_run_word_a_duplicate_key_alike(tmp_path, tiny_model_dir):
    rows = seed_rows(6)
    rows[3]["id"] = rows[1]["id"]
    job = _job(tmp_path, tiny_model_dir)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    validated, ran = _cli("validate", job), _cli("run", job, "--no-progress")
    assert validated.exit_code == ran.exit_code == 2
    error = validated.output.strip()
    assert "duplicate key 'row-0001' (rows 1 and 3)" in error and error in ran.output


def test_validate_refuses_a_sampling_change_against_an_existing_output_as_run_does(tmp_path, tiny_model_dir):
    job = _job(tmp_path, tiny_model_dir)
    assert _cli("run", job, "--no-progress").exit_code == 0
    same = _cli("validate", job)
    assert same.exit_code == 0 and "holds an earlier run of this job; a run resumes it" in same.output
    changed = _cli("validate", job, "--set", "sampling.temperature=0.5")
    assert changed.exit_code == 2
    refused = _cli("run", job, "--no-progress", "--set", "sampling.temperature=0.5")
    assert refused.exit_code == 2
    assert "sampling.temperature: 0.0 -> 0.5" in changed.output and changed.output in refused.output  # same words
    elsewhere = _cli("validate", job, "--set", "sampling.temperature=0.5", "-o", tmp_path / "other")
    assert elsewhere.exit_code == 0 and "holds no earlier run" in elsewhere.output


def test_a_run_that_fails_at_start_leaves_no_output_folder_behind(tmp_path, tiny_model_dir):
    job = _job(tmp_path, str(tmp_path / "no-model"), with_output=False)
    result = _cli("run", job, "--no-progress")
    assert result.exit_code == 2 and "model.path: no such folder" in result.output
    assert not (tmp_path / "out").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert _cli("run", job, "--no-progress", "-o", kept).exit_code == 2
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]  # its lock file removed, the rest untouched


def test_the_automatic_unit_gives_every_worker_rows_whenever_there_are_enough():
    for rows in range(1, 120):
        for count in range(1, 10):
            workers = [WorkerInfo(i, count, auto_unit_rows(rows, count)) for i in range(count)]
            owned = [w.num_owned(rows) for w in workers]
            assert sum(owned) == rows
            assert all(owned) == (rows >= count), (rows, count, owned)
    assert auto_unit_rows(10**6, 8) == auto_unit_rows(None, 8) == DEFAULT_UNIT_ROWS


class _Source:
    """What WorkerInfo.sized_for reads of a Source: its rows, and the count if known up front (Parquet)."""

    def __init__(self, num_rows: int, known: bool) -> None:
        self.total, self.read = num_rows, 0
        self.num_rows = self.expected_rows = num_rows if known else None

    def __iter__(self):
        for position in range(self.total):
            self.read += 1
            yield position


@pytest.mark.parametrize("num_rows", [5, 20, 2047, 5000])
def test_sizing_reads_an_unknown_count_only_as_far_as_it_matters_and_agrees_with_a_known_one(num_rows):
    known = WorkerInfo(1, 2).sized_for(None, _Source(num_rows, known=True))
    unknown_source = _Source(num_rows, known=False)
    counted = WorkerInfo(1, 2).sized_for(None, unknown_source)
    assert counted.unit_rows == known.unit_rows == min(num_rows // 2, DEFAULT_UNIT_ROWS)
    assert unknown_source.read == min(num_rows, 2 * DEFAULT_UNIT_ROWS)
    explicit_source = _Source(num_rows, known=False)
    explicit = WorkerInfo(1, 2).sized_for(3, explicit_source)
    assert explicit.unit_rows == 3 and explicit.unit_rows_from_job and explicit_source.read == 0


def test_the_second_of_two_workers_generates_half_of_twenty_rows(tmp_path, tiny_model_dir):
    job = _job(tmp_path, tiny_model_dir, rows=20)  # JSONL: the row count is read, not known up front
    result = _cli("run", job, "--no-progress", "--worker-index", 1, "--num-workers", 2)
    assert result.exit_code == 0, result.output
    assert "10 rows committed" in result.output
    assert sorted(r["id"] for r in read_rows(tmp_path / "out")) == [f"row-{i:04d}" for i in range(10, 20)]
    report = json.loads((tmp_path / "out" / "reports" / "w00001.json").read_text())
    assert report["worker"] == {"index": 1, "count": 2, "unit_rows": 10, "source_rows": 20}


def test_a_worker_without_rows_says_why_and_exits_zero_with_a_report(tmp_path, tiny_model_dir):
    job = _job(tmp_path, tiny_model_dir, rows=2)
    result = _cli("run", job, "--no-progress", "--worker-index", 2, "--num-workers", 3)
    assert result.exit_code == 0, result.output
    assert "worker 2 of 3 has no rows: the source has 2 rows for 3 workers" in result.output
    assert (tmp_path / "out" / "reports" / "w00002.json").exists()
    result = _cli("run", job, "--no-progress", "--worker-index", 1, "--num-workers", 2,
                  "--set", "source.worker_unit_rows=1024")
    assert result.exit_code == 0, result.output
    assert "dealt in units of source.worker_unit_rows = 1024 and none fell to it" in result.output


def test_validate_counts_the_jsonl_rows_it_renders(tmp_path, tiny_model_dir):
    result = _cli("validate", _job(tmp_path, tiny_model_dir, rows=7))
    assert result.exit_code == 0, result.output
    assert "JSONL file(s)" in result.output and "; 7 rows; columns:" in result.output
    assert "unknown number of" not in result.output


def test_validate_counts_a_jsonl_source_longer_than_its_sample_by_the_key_scan(tmp_path, tiny_model_dir):
    from batchgen.job.validate import audit

    spec = load_spec(_job(tmp_path, tiny_model_dir, rows=9))
    assert "; 9 rows; columns:" in audit(spec, sample_rows=4)  # the key scan reads every row
    no_key = spec.model_copy(update={"source": spec.source.model_copy(update={"key_column": None})})
    assert "; more than 4 rows (the first 4 rendered); columns:" in audit(no_key, sample_rows=4)


@pytest.mark.parametrize("sections", [
    {"sampling": {"thinking_budget": 2}},  # the tokenizer has no <think> / </think>
    {"sampling": {"thinking_budget": 2}, "output": {"reasoning": "auto"}},
    {"sampling": {"thinking_budget": 2}, "output": {"reasoning": {"start": "<>", "end": "STOP"}}},  # 2-token end
], ids=["no-markers", "auto", "two-token-end"])
def test_validate_refuses_a_thinking_budget_without_usable_markers_as_run_does(tmp_path, tiny_model_dir,
                                                                               sections):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"}, **sections)
    runner = CliRunner()
    validated = runner.invoke(app, ["validate", str(job)])
    ran = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert validated.exit_code == ran.exit_code == 2
    assert "sampling.thinking_budget needs" in validated.output and "sampling.thinking_budget needs" in ran.output


def test_a_rows_token_ids_outside_the_vocabulary_are_counted_by_validate_and_rejected_by_run(tmp_path,
                                                                                             tiny_model_dir):
    """A row's own logit_bias or stop_token_ids naming ids the model lacks: validate predicts the bad_sampling reject
    run makes (it said nothing before), naming the field in run's message."""
    rows = seed_rows(5)
    overrides = [None, {"logit_bias": {"999999": 5}}, {"stop_token_ids": [3, 700000]}, {"logit_bias": {"7": 2}},
                 {"max_new_tokens": 4}]
    for r, o in zip(rows, overrides):
        r["params"] = None if o is None else json.dumps(o)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id", "sampling_column": "params"})
    validated = _cli("validate", job)
    assert validated.exit_code == 0, validated.output
    assert "rows that would be rejected in the sample: bad_sampling: 2" in validated.output
    ran = _cli("run", job, "--no-progress")
    assert ran.exit_code == 0, ran.output
    rejects = {r["id"]: r for r in read_rows(tmp_path / "out", "rejects")}
    assert {k: r["error_class"] for k, r in rejects.items()} == {"row-0001": "bad_sampling", "row-0002": "bad_sampling"}
    assert "logit_bias: token ids [999999]" in rejects["row-0001"]["message"]
    assert "stop_token_ids: token ids [700000]" in rejects["row-0002"]["message"]
    assert sorted(r["id"] for r in read_rows(tmp_path / "out")) == ["row-0000", "row-0003", "row-0004"]


def test_rows_an_explicit_kv_cache_cannot_hold_are_counted_by_validate_as_run_rejects_them(tmp_path, tiny_model_dir):
    """Prompts of 34-36 tokens: with a row's own max_new_tokens 4 a sequence fits 5 blocks of 8 tokens, with the
    job's 12 it needs 6: validate predicts run's too_long_for_cache rejects (it said nothing before)."""
    rows = seed_rows(6)
    for i, r in enumerate(rows):
        r["params"] = json.dumps({"max_new_tokens": 4}) if i % 2 else None
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id", "sampling_column": "params"},
                    engine={"num_kv_blocks": 5, "block_size": 8})
    validated = _cli("validate", job)
    assert validated.exit_code == 0, validated.output
    assert "rows that would be rejected in the sample: too_long_for_cache: 3" in validated.output, validated.output
    ran = _cli("run", job, "--no-progress")
    assert ran.exit_code == 0, ran.output
    rejects = {r["id"]: r["error_class"] for r in read_rows(tmp_path / "out", "rejects")}
    assert rejects == {f"row-000{i}": "too_long_for_cache" for i in (0, 2, 4)}


def test_a_prompt_the_context_cannot_hold_under_a_larger_max_prompt_tokens_is_predicted_as_run_rejects_it(
        tmp_path, tiny_model_dir):
    rows = seed_rows(3)
    rows[1]["topic"] = " ".join(f"w{i}" for i in range(400))  # well past the tiny model's 256-token context
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    prompt={"max_prompt_tokens": 4000})
    validated = _cli("validate", job)
    assert validated.exit_code == 0, validated.output
    assert "rows that would be rejected in the sample: too_long_for_cache: 1" in validated.output, validated.output
    ran = _cli("run", job, "--no-progress")
    assert ran.exit_code == 0, ran.output
    assert {r["id"]: r["error_class"] for r in read_rows(tmp_path / "out", "rejects")} == \
        {"row-0001": "too_long_for_cache"}


@pytest.mark.parametrize("overrides", [["engine.num_kv_blocks=100000000000"],
                                       ["engine.num_kv_blocks=null", "engine.cpu_kv_cache_bytes=100000000000000"]])
def test_a_kv_cache_larger_than_the_device_is_refused_by_validate_and_by_run_before_the_weights_load(
        tmp_path, tiny_model_dir, overrides):
    """Before: validate passed it and run refused it only after loading the weights (a long wait on a big model).
    run's weights here are damaged: a run that loaded them first would fail on them instead."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = next(model.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    sets = [a for o in overrides for a in ("--set", o)]
    key = overrides[-1].split("=")[0]
    validated = _cli("validate", _job(tmp_path, tiny_model_dir), *sets)
    ran = _cli("run", _job(tmp_path, str(model)), *sets, "--no-progress")
    for result in (validated, ran):
        assert result.exit_code == 2, result.output
        assert f"{key} (" in result.output and "asks for a K/V cache of at least" in result.output, result.output
        assert "GiB in all" in result.output


def test_validate_takes_runs_deterministic_and_tensor_parallel_flags_and_refuses_what_run_refuses(tmp_path,
                                                                                                  tiny_model_dir):
    job = _job(tmp_path, tiny_model_dir)
    assert _cli("validate", job, "--deterministic").exit_code == 0  # "No such option" before
    for flags in (["--deterministic", "--set", "engine.compile=true"], ["--tensor-parallel", "3"]):
        validated, ran = _cli("validate", job, *flags), _cli("run", job, *flags, "--no-progress")
        assert validated.exit_code == ran.exit_code == 2, (validated.output, ran.output)
        assert validated.output.splitlines()[-1] == ran.output.splitlines()[-1]

"""Bad input gets a clear message naming the key or value, and loses no data; fingerprint drift is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from jobutil import invoke_run, read_rows, seed_rows, six_row_job, write_job, write_jsonl

_run = invoke_run


@pytest.fixture
def job(tmp_path, tiny_model_dir):
    return six_row_job(tmp_path, tiny_model_dir)


def _edit(job, **sections):
    raw = yaml.safe_load(job.read_text())
    for key, value in sections.items():
        raw[key] = {**raw[key], **value}
    job.write_text(yaml.safe_dump(raw))
    return job


@pytest.mark.parametrize("override,message", [
    ("sampling.temprature=0.5", "unknown key 'sampling.temprature': did you mean 'sampling.temperature'?"),
    ("engin.max_num_seqs=4", "unknown key 'engin': did you mean 'engine'?"),
    ("sampling.temperature=-1", "'sampling.temperature' = -1: Input should be greater than or equal to 0"),
    ("sampling.top_p=1.5", "'sampling.top_p' = 1.5"),
    ("sampling.n=0", "'sampling.n' = 0"),
    ("engine.max_num_seqs=0", "'engine.max_num_seqs' = 0"),
    ("sampling.max_new_tokens=lots", "'sampling.max_new_tokens' = 'lots'"),
    ("output.rows_per_shard=-5", "'output.rows_per_shard' = -5"),
    ("sampling.frequency_penalty=2.5", "'sampling.frequency_penalty' = 2.5"),
    # lax pydantic read true as 1 (a typo that silently meant one row, one sequence, temperature 1.0, token 1)
    ("source.limit=true", "'source.limit' = True: limit takes a number, not true or false"),
    ("engine.max_num_seqs=true", "'engine.max_num_seqs' = True: max_num_seqs takes a number, not true or false"),
    ("sampling.temperature=true", "temperature takes a number, not true or false"),
    ("sampling.stop_token_ids=[true]", "stop_token_ids takes a number, not true or false"),
    ("sampling.logit_bias={1.5: 1}", "logit_bias keys are token ids, got 1.5"),
    ("engine.max_model_len=100000", "engine.max_model_len 100000 exceeds the model's context of 256 tokens"),
    ("limits.render_timeout_s=.inf",
     "'limits.render_timeout_s' = inf: Input should be less than or equal to 1000000000"),
    ("sampling.logit_bias={999999: 5}", "sampling.logit_bias: token ids [999999] are outside the model's vocabulary"),
    ("engine.graph_blas_library=auto", "'engine.graph_blas_library' = 'auto': auto was removed"),
    ("engine.graph_blas_library=cublasLt", "'engine.graph_blas_library' = 'cublasLt': Input should be"),
    # each of these once failed every row, or the run itself, with a Python error (exit 1 or all rows rejected)
    ("output.keep_columns=[topic, topic]", "output.keep_columns names 'topic' more than once"),
    ("source.path=[]", "source.path names no input"),
    ("prompt.chat_template_kwargs={add_generation_prompt: false}",
     "prompt.chat_template_kwargs: 'add_generation_prompt' cannot be set here"),
    ("prompt.chat_template_kwargs={messages: 5, enable_thinking: false}",
     "prompt.chat_template_kwargs: 'messages' cannot be set here"),
    ("prompt.chat_template_kwargs={continue_final_message: true, padding: true}",
     "prompt.chat_template_kwargs: 'continue_final_message' cannot be set here"),
])
def test_spec_errors_name_the_key_and_value(job, override, message):
    result = _run(job, "--set", override)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_chat_template_kwargs_that_change_nothing_without_tokenizing_are_accepted(job):
    """padding, return_dict or continue_final_message: false render the same text: refusing them would refuse
    outputs begun with them."""
    result = _run(job, "--set", "prompt.chat_template_kwargs={padding: true, return_dict: true, "
                                "continue_final_message: false}")
    assert result.exit_code == 0, result.output


def test_a_job_file_setting_a_removed_option_is_refused_naming_the_key_and_what_to_do(job):
    raw = yaml.safe_load(job.read_text())
    raw["engine"] = {**raw.get("engine", {}), "admission_group": 4}
    job.write_text(yaml.safe_dump(raw))
    result = _run(job)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "unknown key 'engine.admission_group': this option was removed" in result.output
    assert "delete the line" in result.output


def test_invalid_yaml_and_missing_job_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: x\nsource: [")
    result = _run(bad)
    assert result.exit_code == 2 and "is not valid YAML" in result.output
    result = _run(tmp_path / "nope.yaml")
    assert result.exit_code == 2 and "does not exist" in result.output


def test_template_naming_a_missing_column(job):
    result = _run(_edit(job, prompt={"template": "About {{ topik }}"}))
    assert result.exit_code == 2
    assert "prompt.template uses topik, which is not a column of the source; columns: id, topic, level" in result.output


def test_jinja_syntax_error(job):
    result = _run(_edit(job, prompt={"template": "About {{ topic "}))
    assert result.exit_code == 2 and "Jinja2 syntax error at line 1" in result.output


def test_missing_source_files_and_key_column(job, tmp_path):
    result = _run(_edit(job, source={"path": "missing/*.jsonl"}))
    assert result.exit_code == 2 and "matches no jsonl files" in result.output
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    result = _run(_edit(job, source={"path": "rows.jsonl", "key_column": "uid"}))
    assert result.exit_code == 2 and "source.key_column 'uid' is not a column" in result.output


def test_missing_model_path(job, tmp_path):
    result = _run(_edit(job, model={"path": str(tmp_path / "no-model")}))
    assert result.exit_code == 2 and f"model.path: no such folder {tmp_path / 'no-model'}" in result.output


def test_corrupt_parquet_file_is_named(job, tmp_path):
    pq.write_table(pa.Table.from_pylist(seed_rows(4)), tmp_path / "good.parquet")
    (tmp_path / "bad.parquet").write_bytes((tmp_path / "good.parquet").read_bytes()[:100])
    result = _run(_edit(job, source={"path": "*.parquet"}))
    assert result.exit_code == 2 and "bad.parquet" in result.output and "corrupt or truncated" in result.output


@pytest.mark.parametrize("real_first", [False, True])
def test_a_real_key_spelled_as_an_unparsed_rows_stand_in_stops_the_job_before_it_is_committed_twice(
        job, tmp_path, real_first):
    import json as _json

    lines = [_json.dumps(r) for r in seed_rows(3)]
    clash = _json.dumps({"id": "<unparsed row 3>" if real_first else "<unparsed row 2>", "topic": "x", "level": 1})
    lines[2:2] = [clash, '{"id": "broken", '] if real_first else ['{"id": "broken", ', clash]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    if real_first:  # found at the unparsed row: its stand-in is taken
        said = "row 2's key '<unparsed row 3>' is the key batchgen gives row 3, which could not be parsed"
    else:  # found at the real row: a duplicate of the unparsed row's stand-in
        said = ("duplicate key '<unparsed row 2>' (rows 2 and 3); keys must be unique, or drop key_column to key rows "
                "by position ('<unparsed row 2>' is also the key batchgen gives row 2 when it cannot parse it)")
    checked = _run_cli_validate(job)
    assert checked.returncode == 2 and said in checked.stdout + checked.stderr, checked.stdout + checked.stderr
    failed = _run(job)
    assert failed.exit_code == 2 and said in failed.output, failed.output
    out = tmp_path / "out"
    if out.exists():  # what was committed before the clash was reached is intact (no key twice)
        from batchgen.output.verify import verify

        assert verify(out).intact


def _run_cli_validate(job, *args):
    from jobutil import run_cli

    return run_cli("validate", str(job), *args)


def test_bad_rows_go_to_rejects_and_the_job_goes_on(job, tmp_path):
    rows = seed_rows(5)
    rows[1]["topic"] = "   "  # renders fine
    lines = [__import__("json").dumps(r) for r in rows]
    lines.insert(2, '{"id": "broken", "topic": ')  # malformed JSON line
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    _edit(job, prompt={"template": None, "column": "topic", "chat": False},
          output={"keep_columns": ["level"]})
    result = _run(job, "--set", "prompt.max_prompt_tokens=3")
    assert result.exit_code == 0, result.output
    rejects = {r["row_position"]: r for r in read_rows(tmp_path / "out", "rejects")}
    assert rejects[1]["error_class"] == "empty_prompt"
    assert rejects[2]["error_class"] == "malformed_row" and "malformed JSON" in rejects[2]["message"]
    assert f"line 3 of {tmp_path / 'rows.jsonl'}: malformed JSON" in rejects[2]["message"]  # the file's line
    assert rejects[2]["id"] == "<unparsed row 2>"
    assert {r["error_class"] for p, r in rejects.items() if p not in (1, 2)} <= {"prompt_too_long"}
    done = {r["id"] for r in read_rows(tmp_path / "out")} | {r["id"] for r in rejects.values()}
    assert len(done) == 6  # every row accounted for, once
    again = _run(job, "--set", "prompt.max_prompt_tokens=3")
    assert "0 rows committed" in again.output  # rejects count as done: not retried forever


def test_truncation_policy_keeps_over_long_prompts(job, tmp_path):
    result = _run(job, "--set", "prompt.max_prompt_tokens=4", "--set", "prompt.on_too_long=truncate_left")
    assert result.exit_code == 0, result.output
    out = read_rows(tmp_path / "out")
    assert len(out) == 6 and all(r["num_prompt_tokens"] == 4 for r in out)


def test_resume_with_changed_sampling_is_refused_naming_the_change(job):
    assert _run(job).exit_code == 0
    result = _run(job, "--set", "sampling.temperature=0.5")
    assert result.exit_code == 2
    assert "sampling.temperature: 0.0 -> 0.5" in result.output and "--fresh" in result.output
    result = _run(job, "--set", "prompt.template=Other {{ topic }}")
    assert result.exit_code == 2 and "prompt.template" in result.output
    # a change of the data shards' columns would leave shards of two schemas in one output
    result = _run(job, "--set", "output.keep_token_ids=true")
    assert result.exit_code == 2 and "output_columns.keep_token_ids: False -> True" in result.output
    # the context decides which prompts are too long and where completions stop: a resume under another one
    # mixed two policies in one output (it was taken for a speed knob)
    result = _run(job, "--set", "engine.max_model_len=40")
    assert result.exit_code == 2 and "max_model_len: None -> 40" in result.output


def test_max_model_len_set_to_the_models_own_context_resumes_an_output_begun_without_it(job, tmp_path,
                                                                                         tiny_model_dir):
    own = json.loads((Path(tiny_model_dir) / "config.json").read_text())["max_position_embeddings"]
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    assert _run(job).exit_code == 0
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(6))
    spelled_out = _run(job, "--set", f"engine.max_model_len={own}")  # the same context: the same job
    assert spelled_out.exit_code == 0 and "3 already done" in spelled_out.output, spelled_out.output
    assert _run(job, "--set", f"engine.max_model_len={own - 1}").exit_code == 2  # another context is refused
    # an output whose fingerprint holds the number itself (written before it was recorded as null) resumes too
    path = tmp_path / "out" / "fingerprint.json"
    recorded = json.loads(path.read_text())
    recorded["components"]["max_model_len"] = own
    path.write_text(json.dumps(recorded))
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(7))
    for spelled in ([], ["--set", f"engine.max_model_len={own}"]):
        again = _run(job, *spelled)
        assert again.exit_code == 0, again.output
    assert _run(job, "--set", f"engine.max_model_len={own - 1}").exit_code == 2


def test_an_output_begun_before_max_model_len_was_recorded_resumes_with_it_set(job, tmp_path):
    assert _run(job, "--set", "engine.max_model_len=200").exit_code == 0
    path = tmp_path / "out" / "fingerprint.json"
    recorded = json.loads(path.read_text())
    del recorded["components"]["max_model_len"]  # as written by a batchgen that did not record it
    path.write_text(json.dumps(recorded))
    again = _run(job, "--set", "engine.max_model_len=200")
    assert again.exit_code == 0 and "6 already done" in again.output, again.output


def test_an_output_begun_before_a_fingerprint_component_existed_still_resumes(job, tmp_path):
    assert _run(job).exit_code == 0
    path = tmp_path / "out" / "fingerprint.json"
    recorded = json.loads(path.read_text())
    del recorded["components"]["output_columns"]  # as written by a batchgen that did not record it
    path.write_text(json.dumps(recorded))
    again = _run(job)
    assert again.exit_code == 0 and "6 already done" in again.output, again.output
    assert _run(job, "--set", "sampling.temperature=0.5").exit_code == 2  # the recorded components still count


def test_engine_knob_change_is_accepted_and_fresh_starts_over(job, tmp_path):
    assert _run(job, "--set", "output.rows_per_shard=100").exit_code == 0
    assert _run(job, "--set", "engine.max_num_seqs=2", "--set", "engine.block_size=4").exit_code == 0
    changed = _run(job, "--set", "sampling.seed=9", "--fresh")
    assert changed.exit_code == 0 and "6 rows committed" in changed.output
    assert len(read_rows(tmp_path / "out")) == 6


def test_second_process_on_the_same_output_and_worker_is_refused(job, tmp_path):
    from batchgen.output.lock import WorkerLock

    (tmp_path / "out").mkdir()
    held = WorkerLock(tmp_path / "out", "w00000")
    try:
        result = _run(job)
        assert result.exit_code == 2 and "another batchgen run" in result.output
    finally:
        held.release()
    assert _run(job).exit_code == 0


def test_duplicate_keys_are_refused_naming_the_key_and_rows(job, tmp_path):
    rows = seed_rows(5)
    rows[3]["id"] = rows[1]["id"]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    result = _run(job)
    assert result.exit_code == 2
    assert "duplicate key 'row-0001' (rows 1 and 3)" in result.output


def test_empty_parquet_source_is_an_error(job, tmp_path):
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "topic": pa.array([], pa.string()),
                             "level": pa.array([], pa.int64())}), tmp_path / "empty.parquet")
    result = _run(_edit(job, source={"path": "empty.parquet"}))
    assert result.exit_code == 2 and "holds no rows (empty source)" in result.output


def test_null_non_string_and_non_utf8_prompt_values(job, tmp_path):
    lines = [b'{"id": "a", "topic": null, "level": 1}', b'{"id": "b", "topic": 12345, "level": 1}',
             b'{"id": "c", "topic": "caf\xe9 \xff bytes", "level": 1}', b'{"id": "d", "topic": "fine", "level": 1}']
    (tmp_path / "rows.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    # keep_columns: none, since 12345 fits no text column of the output
    # (see tests/sources/test_nulls_types_and_splits.py)
    _edit(job, prompt={"template": None, "column": "topic", "chat": False}, output={"keep_columns": "none"})
    result = _run(job)
    assert result.exit_code == 0, result.output
    rejects = {r["id"]: r for r in read_rows(tmp_path / "out", "rejects")}
    assert set(rejects) == {"a", "<unparsed row 2>"} and rejects["a"]["error_class"] == "null_value"
    bad = rejects["<unparsed row 2>"]  # invalid UTF-8 is never guessed: the line is a reject naming itself
    assert bad["error_class"] == "malformed_row" and "line 3 of" in bad["message"] and "not valid UTF-8" in bad["message"]
    assert {r["id"] for r in read_rows(tmp_path / "out")} == {"b", "d"}  # 12345 rendered as text


def test_chat_template_that_raises_for_a_row_rejects_only_that_row(job, tmp_path, tiny_model_dir):
    import shutil

    model = tmp_path / "model-raising"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if 'rome' in m['content'] %}"
                               "{{ raise_exception('no Rome allowed') }}{% endif %}{{ m['content'] }}{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    result = _run(_edit(job, model={"path": str(model)}))
    assert result.exit_code == 0, result.output
    rejects = read_rows(tmp_path / "out", "rejects")
    assert [r["id"] for r in rejects] == ["row-0002"]
    assert rejects[0]["error_class"] == "chat_template_error" and "no Rome allowed" in rejects[0]["message"]
    assert len(read_rows(tmp_path / "out")) == 5


def test_model_folder_without_weights_and_a_fake_gguf_are_named(job, tmp_path, tiny_model_dir):
    import shutil

    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    result = _run(_edit(job, model={"path": str(no_weights)}))
    assert result.exit_code == 2 and f"model.path '{no_weights}'" in result.output
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "model.gguf").write_text("this is not a GGUF file")
    result = _run(_edit(job, model={"path": str(fake), "gguf_file": "model.gguf"}))
    assert result.exit_code == 2 and "gguf_file 'model.gguf'" in result.output


def test_a_run_with_a_thousand_shards_loads_with_datasets(job, tmp_path):
    import datasets

    write_jsonl(tmp_path / "rows.jsonl", seed_rows(1000))
    result = _run(job, "--set", "output.rows_per_shard=1", "--set", "sampling.max_new_tokens=1",
                  "--set", "engine.max_num_seqs=64")
    assert result.exit_code == 0, result.output
    files = sorted(str(p) for p in (tmp_path / "out" / "data").glob("*.parquet"))
    assert len(files) >= 1000
    ds = datasets.load_dataset("parquet", data_files=files, split="train")
    assert ds.num_rows == 1000 and len(set(ds["id"])) == 1000


def test_a_set_into_a_section_written_empty_or_null_fills_it(tmp_path, tiny_model_dir):
    """`sampling:` written empty, or `response_format: null`: --set sampling.temperature=0 and --set
    sampling.response_format.type=json_object set the key (they said "'sampling' is not a section")."""
    from batchgen.errors import JobError
    from batchgen.job.job_file import load_spec

    write_jsonl(tmp_path / "rows.jsonl", seed_rows(2))
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {{path: {tiny_model_dir}}}\nsource: {{path: rows.jsonl}}\n"
                   f"prompt: {{template: '{{{{ topic }}}}'}}\nsampling:\n")
    assert load_spec(job, ["sampling.temperature=0"]).sampling.temperature == 0
    job.write_text(job.read_text() + "  response_format: null\n")
    spec = load_spec(job, ["sampling.response_format.type=json_object"])
    assert spec.sampling.response_format.type == "json_object"
    with pytest.raises(JobError, match="'temperature' is not a section"):
        load_spec(job, ["sampling.temperature=0", "sampling.temperature.x=1"])  # a value is still no section


@pytest.mark.parametrize("column", ["finish_reason", "sample_idx", "seed"])
def test_a_key_column_named_like_an_output_column_is_refused_before_any_shard(job, tmp_path, column):
    rows = [{**r, column: f"k{i}"} for i, r in enumerate(seed_rows(3))]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    said = f"source.key_column {column!r} is also the name of a column batchgen writes"
    checked = _run_cli_validate(job, "--set", f"source.key_column={column}")
    assert checked.returncode == 2 and said in checked.stderr, checked.stdout + checked.stderr
    failed = _run(job, "--set", f"source.key_column={column}")
    assert failed.exit_code == 2 and said in failed.output, failed.output
    assert not (tmp_path / "out").exists()


def test_chat_template_kwargs_without_a_chat_template_are_refused_not_ignored(job, tmp_path):
    result = _run(job, "--set", "prompt.chat=false", "--set", "prompt.chat_template_kwargs={enable_thinking: false}")
    assert result.exit_code == 2 and "with prompt.chat: false no chat template runs" in result.output, result.output
    # an output an earlier batchgen made with them is still read: the check is a run's, not the saved job's
    assert _run(job).exit_code == 0
    saved = tmp_path / "out" / "job.resolved.yaml"
    header, body = saved.read_text().split("\n", 1)
    resolved = yaml.safe_load(body)
    resolved["prompt"].update(chat=False, chat_template_kwargs={"enable_thinking": False})
    saved.write_text(header + "\n" + yaml.safe_dump(resolved))
    from typer.testing import CliRunner

    from batchgen.cli import app

    exported = CliRunner().invoke(app, ["export", str(tmp_path / "out"), "--to", str(tmp_path / "all.jsonl")])
    assert exported.exit_code == 0, exported.output


def test_max_model_len_may_reach_the_context_a_rope_scaling_factor_stretches_to(tmp_path, tiny_model_dir):
    """A yarn-scaled model (factor 4 over 256 positions) runs with a 1,024-token context; beyond it is refused."""
    import shutil

    model = tmp_path / "yarn"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                 "rope_theta": config.get("rope_theta", 10000.0)}
    (model / "config.json").write_text(json.dumps(config))
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    job = write_job(tmp_path, str(model), {"path": "rows.jsonl", "key_column": "id"})
    assert _run_cli_validate(job, "--set", "engine.max_model_len=1024").returncode == 0
    refused = _run_cli_validate(job, "--set", "engine.max_model_len=1025")
    assert refused.returncode == 2 and "exceeds the model's context of 1024 tokens" in refused.stderr, refused.stderr

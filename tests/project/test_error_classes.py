"""Every error in its class: a user's mistake or bad file exits 2 saying what to fix, in `validate` as in
`run` (validate refuses everything run refuses); exit 1 ("run the same command again") only where running
again can help: a full disk, an I/O fault, a fault inside the engine."""

from __future__ import annotations

import errno
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
import yaml
from typer.testing import CliRunner

from batchgen.cli import _user_errors, app
from jobutil import seed_rows, write_job, write_jsonl

runner = CliRunner()


def _garbage_weights(tmp_path, model_dir):
    model = tmp_path / "garbage-model"
    shutil.copytree(model_dir, model)
    (model / "model.safetensors").write_bytes(b"\x00\xff garbage, not a safetensors file" * 100)
    return {"model": {"path": str(model)}}


def _mixed_keys(tmp_path, model_dir):
    write_jsonl(tmp_path / "rows.jsonl", [{**r, "id": i if i < 3 else f"key-{i}"} for i, r in enumerate(seed_rows(4))])
    return {}


def _huge_int_keys(tmp_path, model_dir):
    keys = [2**64 + 1, 5, -3, 2**64 + 2]  # integers all, two beyond int64
    write_jsonl(tmp_path / "rows.jsonl", [{**r, "id": keys[i]} for i, r in enumerate(seed_rows(4))])
    return {}


def _parquet_types(tmp_path, model_dir):
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"id": ["a"], "topic": ["tea"], "level": [1]}), data / "0.parquet")
    pq.write_table(pa.table({"id": ["b"], "topic": ["owls"], "level": ["two"]}), data / "1.parquet")
    return {"source": {"path": "data", "key_column": "id"}}


def _deep_schema(tmp_path, model_dir):
    schema = {"type": "string"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}}
    return {"sampling": {"response_format": {"type": "json_schema", "json_schema": schema}}}


BAD_JOBS = {  # name: (sections to change, or a function of (tmp_path, model dir) returning them; what the message says)
    "include": ({"prompt": {"template": "{% include 'x' %}{{ topic }}"}}, "{% include %} is not available"),
    "range_1e9": ({"prompt": {"template": "{% for i in range(10**9) %}{% endfor %}{{ topic }}"}},
                  "more than limits.max_render_steps"),
    "string_bomb": ({"prompt": {"template": "{{ 'a' * 400000000 }}{{ topic }}"}}, "limits.max_prompt_chars"),
    "grammar_root_root": ({"sampling": {"response_format": {"type": "grammar", "grammar": "root ::= root"}}},
                          "admits no completion"),
    "deep_schema": (_deep_schema, "nests more than 64"),
    "max_new_tokens_1e9": ({"sampling": {"max_new_tokens": 1_000_000_000}}, "'sampling.max_new_tokens'"),
    "max_new_tokens_over_context": ({"sampling": {"max_new_tokens": 300}}, "leaves no room for a prompt"),
    "n_1e6": ({"sampling": {"n": 1_000_000}}, "limits.max_samples_per_row"),
    "mixed_key_types": (_mixed_keys, "keys must all be strings or all integers"),
    "huge_int_keys": (_huge_int_keys, "an integer outside the 64-bit range keys are stored in"),
    "garbage_safetensors": (_garbage_weights, "model.safetensors is damaged or not a safetensors file"),
    "parquet_column_types": (_parquet_types, "column 'level' is int64"),
}


@pytest.mark.parametrize("name", list(BAD_JOBS))
def test_validate_refuses_what_run_refuses_with_exit_2_and_the_same_message(tmp_path, tiny_model_dir, name):
    change, message = BAD_JOBS[name]
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(4))
    sections = change(tmp_path, tiny_model_dir) if callable(change) else change
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"})
    raw = yaml.safe_load(job.read_text())
    for key, value in sections.items():
        raw[key] = {**raw[key], **value}
    job.write_text(json.dumps(raw))  # JSON is YAML; PyYAML's dumper cannot nest a deep schema
    results = {command: runner.invoke(app, [command, str(job), *(["--no-progress"] if command == "run" else [])])
               for command in ("validate", "run")}
    for command, result in results.items():
        assert result.exit_code == 2, f"{command}: {result.output}"
        assert message in " ".join(result.output.split()), f"{command}: {result.output}"
        assert "run the same command again" not in result.output and "Traceback" not in result.output
    assert not list((tmp_path / "out").glob("data/*.parquet"))


def test_a_garbage_model_safetensors_exits_2_naming_the_file(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(2))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl"}, **_garbage_weights(tmp_path, tiny_model_dir))
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 2
    assert f"the weight file {tmp_path / 'garbage-model' / 'model.safetensors'} is damaged" in result.output


def _exit_of(error: BaseException, capsys) -> tuple[int, str]:
    @_user_errors
    def command():
        raise error

    with pytest.raises(typer.Exit) as e:
        command()
    return e.value.exit_code, capsys.readouterr().err


@pytest.mark.parametrize("code", [errno.ENOENT, errno.EACCES, errno.EISDIR, errno.ENOTDIR, errno.EROFS])
def test_a_path_or_permission_error_is_the_users_to_fix_exit_2(capsys, code):
    exit_code, err = _exit_of(OSError(code, "cannot", "/data/x"), capsys)
    assert exit_code == 2 and "/data/x" in err and "fix the path or its permissions" in err


def test_a_full_disk_exits_1_saying_free_space_and_run_again(capsys):
    exit_code, err = _exit_of(OSError(errno.ENOSPC, "No space left on device", "/out/data"), capsys)
    assert exit_code == 1 and "free disk space and run the same command again to resume" in err


def test_input_nested_too_deeply_exits_2_not_run_again(capsys):
    exit_code, err = _exit_of(RecursionError("maximum recursion depth exceeded"), capsys)
    assert exit_code == 2 and "nests too deeply" in err and "run the same command again" not in err


def test_an_engine_fault_still_says_run_again_with_exit_1(capsys):
    exit_code, err = _exit_of(RuntimeError("CUDA error: an illegal memory access"), capsys)
    assert exit_code == 1 and "run the same command again to resume" in err

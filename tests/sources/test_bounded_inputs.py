"""What a job may ask is bounded: job files (size, YAML aliases), samples per row, max_new_tokens, template
renders (steps, sizes, include), chat-template renders, response formats, and sources whose files disagree on
a column's type. Each is refused with a message naming the key (exit 2) or rejects its row, before any large
allocation: the limits here are hit with small inputs or checked before the work they guard."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.errors import JobError, RowError
from batchgen.config import LimitsSpec, PromptSpec
from batchgen.job.job_file import load_spec
from batchgen.prompts import FAIL_FAST_ROWS, PromptRenderer
from jobutil import read_rows, seed_rows, write_job, write_jsonl

runner = CliRunner()
ROW = {"id": "a", "topic": "tea", "level": 1}


def _cli(*args):
    return runner.invoke(app, [*map(str, args), *(["--no-progress"] if args[0] == "run" else [])])


def _renderer(template: str, tokenizer, **limits) -> PromptRenderer:
    spec = PromptSpec(template=template, chat=False)
    spec._limits = LimitsSpec(**limits)
    return PromptRenderer(spec, tokenizer, list(ROW), 100)


def _job(tmp_path, model_dir, **sections):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(4))
    return write_job(tmp_path, model_dir, {"path": "rows.jsonl", "key_column": "id"}, **sections)


# ---- the job file ------------------------------------------------------------------------------------------
def test_a_yaml_alias_bomb_is_refused_naming_the_file(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]  # 9**10 nodes expanded
    job = tmp_path / "bomb.yaml"
    job.write_text("model: {path: m}\nsource: {path: rows.jsonl}\nprompt: {column: text}\nbomb:\n"
                   + "".join(f"  {line}\n" for line in lines))
    t0 = time.perf_counter()
    with pytest.raises(JobError) as e:
        load_spec(job)
    assert time.perf_counter() - t0 < 2
    assert f"job file {job} expands to more than 1000000 YAML nodes through its aliases" in str(e.value)


def test_yaml_aliases_that_stay_small_are_still_allowed(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("model: {path: m}\nsource: {path: rows.jsonl}\nprompt: {column: text, system: &sys Be brief.}\n"
                   "sampling: {seed: 3, stop: [*sys]}\n")
    assert load_spec(job).sampling.stop == ("Be brief.",)


def test_a_key_written_twice_in_one_section_is_refused_naming_it_and_both_lines(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("model: {path: m}\nsource: {path: rows.jsonl}\nprompt: {column: text}\nsampling:\n"
                   "  temperature: 0.7\n  seed: 3\n  temperature: 1.5\n")
    with pytest.raises(JobError) as e:
        load_spec(job)
    assert f"job file {job}: key 'temperature' is written twice in one section (lines 5 and 7)" in str(e.value)
    # the same key in two sections, and YAML merge keys, are not repeats
    job.write_text("model: {path: m}\nsource: {path: rows.jsonl, limit: 2}\nprompt: {column: text}\n"
                   "base: &b {seed: 3}\nsampling: {<<: *b, temperature: 0.5}\nlimits: {}\n")
    with pytest.raises(JobError, match="'base'"):  # an unknown top-level key, not a repeat
        load_spec(job)


def test_a_job_file_larger_than_its_cap_is_refused_before_parsing(tmp_path):
    job = tmp_path / "huge.yaml"
    job.write_text("model: {path: m}\nnote: '" + "x" * (5 << 20) + "'\n")
    with pytest.raises(JobError) as e:
        load_spec(job)
    assert "more than the 4194304 a job file may hold" in str(e.value)


# ---- samples and tokens ------------------------------------------------------------------------------------
def test_sampling_n_above_limits_max_samples_per_row_exits_2_naming_the_key(tmp_path, tiny_model_dir):
    job = _job(tmp_path, tiny_model_dir, sampling={"n": 1_000_000})
    for command in ("validate", "run"):
        result = _cli(command, job)
        assert result.exit_code == 2, result.output
        assert "'sampling.n' = 1000000: more samples per row than limits.max_samples_per_row (256)" in result.output
    assert not (tmp_path / "out").exists()
    assert load_spec(job, ["limits.max_samples_per_row=1000000"]).sampling.n == 1_000_000  # a cap one may raise


def test_a_rows_own_sampling_asking_for_more_samples_than_the_limit_is_a_bad_sampling_reject(tmp_path, tiny_model_dir):
    from batchgen.job.row_sampling import RowSampling

    write_jsonl(tmp_path / "rows.jsonl", seed_rows(4))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id", "sampling_column": "sampling"})
    rows = RowSampling(load_spec(job), ["id", "topic", "level", "sampling"])
    assert rows.params_for({"sampling": {"n": 256}}).n == 256
    with pytest.raises(RowError) as e:
        rows.params_for({"sampling": json.dumps({"n": 1_000_000})})
    assert e.value.error_class == "bad_sampling" and "limits.max_samples_per_row (256)" in str(e.value)


def test_an_openai_batch_line_asking_for_a_million_samples_is_a_bad_sampling_reject(tmp_path, tiny_model_dir):
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"hi {i}"}], "n": 1_000_000 if i == 1 else 1}}
             for i in range(3)]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": {"path": tiny_model_dir, "device": "cpu"},
                                   "source": {"path": "batch.jsonl"}, "sampling": {"max_new_tokens": 4},
                                   "engine": {"max_num_seqs": 4, "num_kv_blocks": 64, "block_size": 8},
                                   "output": {"dir": "out", "report": False}}))
    result = _cli("run", job)
    assert result.exit_code == 0, result.output
    rejects = read_rows(tmp_path / "out", "rejects")
    assert [r["custom_id"] for r in rejects] == ["r1"] and rejects[0]["error_class"] == "bad_sampling"
    assert "n (1000000 is more than 128, OpenAI's own limit on n)" in rejects[0]["message"]
    assert sorted(r["custom_id"] for r in read_rows(tmp_path / "out")) == ["r0", "r2"]


def test_max_new_tokens_of_a_billion_is_refused_by_the_schema(tmp_path, tiny_model_dir):
    result = _cli("validate", _job(tmp_path, tiny_model_dir, sampling={"max_new_tokens": 1_000_000_000}))
    assert result.exit_code == 2
    assert "'sampling.max_new_tokens' = 1000000000: more than 16777216" in result.output
    assert "-token limit" not in result.output


def test_validate_refuses_max_new_tokens_that_leave_no_room_in_the_context_as_run_does(tmp_path, tiny_model_dir):
    job = _job(tmp_path, tiny_model_dir, sampling={"max_new_tokens": 5000})  # the tiny model's context: 256
    for command in ("validate", "run"):
        result = _cli(command, job)
        assert result.exit_code == 2, result.output
        assert "sampling.max_new_tokens (5000) leaves no room for a prompt in the model's context of 256 tokens" \
            in result.output


# ---- prompt templates --------------------------------------------------------------------------------------
def test_an_include_in_the_template_is_a_job_error_naming_prompt_template(tokenizer):
    with pytest.raises(JobError) as e:
        _renderer("{% include 'other.j2' %}{{ topic }}", tokenizer)
    assert "prompt.template line 1: {% include %} is not available" in str(e.value)


@pytest.mark.parametrize("template,message", [
    ("{% for i in range(10**9) %}{% endfor %}{{ topic }}", "range() of 1000000000 items is more than "
                                                           "limits.max_render_steps"),
    ("{{ 'a' * 400000000 }}{{ topic }}", "a `*` of a str would be 400000000 long, more than limits.max_prompt_chars"),
    ("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}{{ topic }}",
     "more than limits.max_render_steps (10000) loop iterations and calls"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "a `~` concatenation would be"),
    ("{{ 'a' | center(10**9) }}", "the center filter's result would be 1000000000 long"),
    ("{{ '{:>1000000000}'.format(topic) }}", "a format width would be 1000000000 long"),
    ("{{ range(9000) | join('x' * 100000) }}", "a join would be"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
])
def test_a_template_over_its_limits_rejects_the_row_fast_as_template_error(tokenizer, template, message):
    r = _renderer(template, tokenizer, max_render_steps=10_000)
    t0 = time.perf_counter()
    with pytest.raises(RowError) as e:
        r.render(ROW)
    assert time.perf_counter() - t0 < 1
    assert e.value.error_class == "template_error" and message in str(e.value)


def test_a_template_over_its_limits_on_each_of_the_first_rows_stops_the_job(tokenizer):
    r = _renderer("{% for i in range(10**9) %}{% endfor %}{{ topic }}", tokenizer)
    for _ in range(FAIL_FAST_ROWS - 1):
        with pytest.raises(RowError):
            r.render(ROW)
    with pytest.raises(JobError) as e:
        r.render(ROW)
    assert f"prompt.template went over a limit on each of the first {FAIL_FAST_ROWS} rows" in str(e.value)


def test_a_template_over_its_limits_on_some_rows_only_rejects_those_rows(tokenizer):
    r = _renderer("{% for c in topic %}{% for d in topic %}.{% endfor %}{% endfor %}", tokenizer,
                  max_render_steps=500)
    assert r.render({**ROW, "topic": "tea"}) == "." * 9
    for _ in range(FAIL_FAST_ROWS + 1):
        with pytest.raises(RowError) as e:
            r.render({**ROW, "topic": "t" * 100})  # 100 + 100 x 100 steps
        assert e.value.error_class == "template_error"


def test_a_template_output_longer_than_max_prompt_chars_is_stopped_while_streaming(tokenizer):
    r = _renderer("{% for i in range(50) %}{{ topic }}{% endfor %}", tokenizer, max_prompt_chars=100)
    with pytest.raises(RowError) as e:
        r.render(ROW)
    assert "the rendered prompt is longer than limits.max_prompt_chars (100 characters)" in str(e.value)


def test_templates_within_the_limits_render_as_before(tokenizer):
    template = ("Hi {{ topic ~ '!' }} {% for x in [1, 2, 3] %}{{ loop.index }}{{ x }}{% endfor %} "
                "{{ ['a', 'b'] | join(', ') }} {{ topic | upper | center(9) }} {{ '%5s' % topic }} {{ 2 ** 10 }} "
                "{{ '{:>5}'.format(topic) }} {{ topic * 2 }} {{ 'x\ny' | indent(2) }} {{ '-'.join(topic | map('upper')) }} "
                "{{ topic | map('upper') | join('+') }}")
    assert _renderer(template, tokenizer).render(ROW) == \
        "Hi tea! 112233 a, b    TEA      tea 1024   tea teatea x\n  y T-E-A T+E+A"


def test_a_column_longer_than_max_prompt_chars_is_rejected_before_the_tokenizer_or_cut(tokenizer):
    spec = PromptSpec(column="topic", chat=False)
    spec._limits = LimitsSpec(max_prompt_chars=50)
    r = PromptRenderer(spec, tokenizer, list(ROW), 1000)
    with pytest.raises(RowError) as e:
        r.tokenize(r.render({**ROW, "topic": "word " * 100}))
    assert e.value.error_class == "prompt_too_long" and "limits.max_prompt_chars (50)" in str(e.value)
    cut = PromptSpec(column="topic", chat=False, on_too_long="truncate_right")
    cut._limits = LimitsSpec(max_prompt_chars=50)
    ids = PromptRenderer(cut, tokenizer, list(ROW), 1000).tokenize("word " * 100)
    assert ids and len(tokenizer.decode(ids)) <= 50


def test_a_chat_template_with_nested_loops_stops_validate_fast_with_exit_2(tmp_path, tiny_model_dir):
    import shutil

    model = tmp_path / "model-loops"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                               "{{ messages[0]['content'] }}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    job = _job(tmp_path, str(model), limits={"render_timeout_s": 0.2})
    t0 = time.perf_counter()
    result = _cli("validate", job)
    assert time.perf_counter() - t0 < 10
    assert result.exit_code == 2, result.output
    assert "the model's chat template went over a limit on each of the first 3 rows" in result.output
    assert "limits.render_timeout_s (0.2 s)" in result.output


# ---- response formats --------------------------------------------------------------------------------------
def _deep_schema(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("response_format,message", [
    ({"type": "grammar", "grammar": "root ::= root"}, "sampling.response_format.grammar: xgrammar cannot use it: it "
                                                      "admits no completion"),
    ({"type": "json_schema", "json_schema": _deep_schema(200)}, "sampling.response_format.json_schema: xgrammar "
                                                                 "cannot use it: the schema nests more than 64"),
])
def test_a_response_format_that_cannot_work_is_refused_by_validate_and_run_naming_the_key(
        tmp_path, tiny_model_dir, response_format, message):
    job = tmp_path / "job.yaml"
    _job(tmp_path, tiny_model_dir)
    raw = yaml.safe_load(job.read_text())
    raw["sampling"]["response_format"] = response_format
    job.write_text(json.dumps(raw))  # JSON is YAML; PyYAML's dumper cannot nest 400 levels
    for command in ("validate", "run"):
        result = _cli(command, job)
        assert result.exit_code == 2, result.output
        assert message in result.output
    assert not (tmp_path / "out").exists()


# ---- sources -----------------------------------------------------------------------------------------------
def test_a_column_changing_type_between_parquet_files_is_refused_naming_column_types_and_files(
        tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"id": ["a", "b"], "topic": ["tea", "rain"], "level": pa.array([1, 2], pa.int64())}),
                   data / "part-0.parquet")
    pq.write_table(pa.table({"id": ["c", "d"], "topic": ["owls", "salt"], "level": ["three", "four"]}),
                   data / "part-1.parquet")
    job = write_job(tmp_path, tiny_model_dir, {"path": "data", "key_column": "id"})
    for command in ("validate", "run"):
        result = _cli(command, job)
        assert result.exit_code == 2, result.output
        assert (f"column 'level' is int64 in Parquet file {data / 'part-0.parquet'} but string in "
                f"{data / 'part-1.parquet'}") in " ".join(result.output.split())
    assert not (tmp_path / "out" / "data").exists() or not list((tmp_path / "out" / "data").iterdir())


def test_a_column_all_null_in_one_parquet_file_takes_the_other_files_type(tmp_path):
    from batchgen.config import SourceSpec
    from batchgen.sources import open_source

    pq.write_table(pa.table({"id": ["a"], "score": pa.array([None], pa.null())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": ["b"], "score": pa.array([2.5], pa.float64())}), tmp_path / "b.parquet")
    source = open_source(SourceSpec(path=str(tmp_path / "*.parquet")))
    assert source.schema.field("score").type == pa.float64()
    assert [r.columns["score"] for r in source] == [None, 2.5]

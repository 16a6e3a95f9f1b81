"""A new user's first hour, the inputs (issue 17): nulls in templates, sandboxed templates, JSONL values that
do not fit their column, files whose content contradicts their type, and splits that do not exist."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.errors import JobError, RowError
from batchgen.job.spec import PromptSpec, SourceSpec
from batchgen.prompts import PromptRenderer
from batchgen.sources import open_source
from jobutil import REPO, read_rows, seed_rows, write_job, write_jsonl

runner = CliRunner()
COLUMNS = ["id", "topic", "level"]


def _renderer(template: str, tokenizer) -> PromptRenderer:
    return PromptRenderer(PromptSpec(template=template, chat=False), tokenizer, COLUMNS, 100)


# ---- item 3: a null in a column the template uses ---------------------------------------------------------
def test_a_null_column_used_by_the_template_rejects_the_row_as_null_value_naming_the_column(tokenizer):
    with pytest.raises(RowError) as e:
        _renderer("Write a haiku about {{ topic }}.", tokenizer).render({"id": "a", "topic": None, "level": 1})
    assert e.value.error_class == "null_value"
    assert "column 'topic' is null" in str(e.value) and "default" in str(e.value)


def test_a_template_default_renders_for_a_null_column_and_not_for_a_present_one(tokenizer):
    r = _renderer("A haiku about {{ topic | default('the moon') }}.", tokenizer)
    assert r.render({"id": "a", "topic": None, "level": 1}) == "A haiku about the moon."
    assert r.render({"id": "a", "topic": "bees", "level": 1}) == "A haiku about bees."
    guarded = _renderer("{% if topic is defined %}{{ topic }}{% else %}anything{% endif %}", tokenizer)
    assert guarded.render({"id": "a", "topic": None, "level": 1}) == "anything"


def test_a_null_in_a_column_the_template_does_not_use_is_no_reject(tokenizer):
    assert _renderer("About {{ topic }}.", tokenizer).render({"id": "a", "topic": "tea", "level": None}) \
        == "About tea."


def test_other_template_failures_stay_template_error(tokenizer):
    with pytest.raises(RowError) as e:
        _renderer("{{ topic.missing_key }}", tokenizer).render({"id": "a", "topic": {"x": 1}, "level": 1})
    assert e.value.error_class == "template_error"


# ---- item 16: templates run in Jinja2's sandbox -----------------------------------------------------------
@pytest.mark.parametrize("template", ["{{ ''.__class__.__mro__[1].__subclasses__() }}",
                                      "{{ topic.__class__ }}", "{% set l = [1] %}{{ l.append(2) }}"])
def test_a_template_reaching_python_internals_stops_the_job_naming_prompt_template(tokenizer, template):
    with pytest.raises(JobError) as e:
        _renderer(template, tokenizer).render({"id": "a", "topic": "tea", "level": 1})
    assert str(e.value).startswith("prompt.template is not allowed (template_error)")
    assert "unsafe" in str(e.value)


def test_a_sandbox_escape_in_a_job_exits_2_with_one_message_and_writes_no_rows(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    prompt={"template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "prompt.template is not allowed" in result.output and "Traceback" not in result.output
    assert read_rows(tmp_path / "out") == [] and read_rows(tmp_path / "out", "rejects") == []

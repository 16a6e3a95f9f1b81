"""Inputs as they come: nulls in templates, sandboxed templates, JSONL values that do not fit their column, files
whose content contradicts their type, and splits that do not exist, each named or rejected as its kind."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.errors import JobError, RowError
from batchgen.config import PromptSpec, SourceSpec
from batchgen.output.schema import fits
from batchgen.prompts import PromptRenderer
from batchgen.sources import open_source
from batchgen.sources.jsonl import column_type
from jobutil import REPO, read_rows, seed_rows, write_job, write_jsonl

runner = CliRunner()
COLUMNS = ["id", "topic", "level"]


def _renderer(template: str, tokenizer) -> PromptRenderer:
    return PromptRenderer(PromptSpec(template=template, chat=False), tokenizer, COLUMNS, 100)


# ---- a null in a column the template uses ------------------------------------------------------------------------
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


# ---- templates run in Jinja2's sandbox ---------------------------------------------------------------------------
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


# ---- JSONL values that do not fit their column's type ------------------------------------------------------------
def test_column_types_come_from_the_most_common_kind_when_the_first_rows_mix_kinds():
    assert column_type([1, 2, None, 3]) == pa.int64()
    assert column_type([1, 2.5]) == pa.float64()  # numbers: ints fit a float column
    assert column_type([None, 12345, "café", "fine"]) == pa.string()
    assert column_type(["five", 5, 6, 7]) == pa.int64()
    assert column_type([None, None]) == pa.string()
    assert column_type([[{"role": "user", "name": None}]]) == \
        pa.list_(pa.struct([("role", pa.string()), ("name", pa.string())]))


@pytest.mark.parametrize("value,arrow_type,ok", [
    ("x", pa.string(), True), (12345, pa.string(), False), ({"a": 1}, pa.string(), False),
    (3, pa.int64(), True), (2.5, pa.int64(), False), ("3", pa.int64(), False), (True, pa.int64(), False),
    (2 ** 63, pa.int64(), False), (3, pa.float64(), True), (True, pa.float64(), False),
    (True, pa.bool_(), True), (1, pa.bool_(), False), (None, pa.int64(), True),
    ([1, 2], pa.list_(pa.int64()), True), ([1, "x"], pa.list_(pa.int64()), False),
    ({"a": 1}, pa.struct([("a", pa.int64()), ("b", pa.string())]), True),
    ({"a": 1, "c": 2}, pa.struct([("a", pa.int64())]), False),
])
def test_a_value_fits_a_column_type_only_as_it_is(value, arrow_type, ok):
    assert fits(value, arrow_type) is ok


def test_jsonl_values_that_do_not_fit_their_column_are_schema_mismatch_rejects_not_text(tmp_path, tiny_model_dir):
    rows = seed_rows(8)
    rows[2]["level"] = "two"  # the first rows say level is an integer
    rows[4]["level"] = True  # a bool is no integer
    rows[5]["topic"] = None  # used by the template: null_value
    rows[6]["topic"] = ["a", "list"]  # renders, but does not fit the text column
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    rejects = {r["id"]: r for r in read_rows(tmp_path / "out", "rejects")}
    assert {k: r["error_class"] for k, r in rejects.items()} == {
        "row-0002": "schema_mismatch", "row-0004": "schema_mismatch", "row-0005": "null_value",
        "row-0006": "schema_mismatch"}
    assert "column 'level' holds 'two' (str)" in rejects["row-0002"]["message"]
    assert "int64" in rejects["row-0002"]["message"] and "output.keep_columns" in rejects["row-0002"]["message"]
    assert "column 'topic' is null" in rejects["row-0005"]["message"]
    data = read_rows(tmp_path / "out")
    assert sorted(r["id"] for r in data) == ["row-0000", "row-0001", "row-0003", "row-0007"]
    assert all(isinstance(r["level"], int) for r in data)  # kept as integers, not JSON text
    table = pq.read_table(sorted((tmp_path / "out" / "data").glob("*.parquet"))[0])
    assert table.schema.field("level").type == pa.int64()


# ---- a file whose content contradicts its extension or source.type -----------------------------------------------
def test_a_parquet_file_named_jsonl_is_named_as_parquet(tmp_path):
    pq.write_table(pa.Table.from_pylist(seed_rows(3)), tmp_path / "rows.jsonl")
    with pytest.raises(JobError) as e:
        open_source(SourceSpec(path=str(tmp_path / "rows.jsonl")))
    assert str(e.value) == (f"file {tmp_path / 'rows.jsonl'} looks like Parquet (it begins with PAR1), but its "
                            f"extension says JSONL; rename it or set source.type: parquet")


def test_a_jsonl_file_named_parquet_or_typed_parquet_is_named_as_jsonl(tmp_path):
    write_jsonl(tmp_path / "rows.parquet", seed_rows(3))
    with pytest.raises(JobError) as e:
        open_source(SourceSpec(path=str(tmp_path / "rows.parquet")))
    assert "looks like JSONL (it begins with {), but its extension says Parquet" in str(e.value)
    assert "corrupt" not in str(e.value)
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    with pytest.raises(JobError) as e:
        open_source(SourceSpec(path=str(tmp_path / "rows.jsonl"), type="parquet"))
    assert "looks like JSONL (it begins with {), but source.type parquet says Parquet; set source.type: jsonl" \
        in str(e.value)
    assert open_source(SourceSpec(path=str(tmp_path / "rows.parquet"), type="jsonl")).columns == COLUMNS


# ---- source.split must name a split that exists ------------------------------------------------------------------
CHAT_DATASET = str(REPO / "jobs" / "examples" / "data" / "chat_dataset")


def test_a_single_dataset_folder_has_one_split_train_and_other_splits_are_errors():
    with pytest.raises(JobError) as e:
        open_source(SourceSpec(path=CHAT_DATASET, split="test"))
    assert str(e.value) == (f"source.split 'test' is not a split of dataset {CHAT_DATASET}: it holds a single "
                            f"Dataset, whose one split is 'train'; set source.split: train")
    assert open_source(SourceSpec(path=CHAT_DATASET, split="train")).num_rows == 11


def test_a_list_of_datasets_is_refused_as_only_its_first_would_be_read():
    with pytest.raises(JobError, match="source.path lists 2 paths, read as Hugging Face datasets"):
        open_source(SourceSpec(path=[CHAT_DATASET, CHAT_DATASET]))
    assert open_source(SourceSpec(path=[CHAT_DATASET])).num_rows == 11


@pytest.mark.parametrize("given,key", [({"name": "subset"}, "source.name"), ({"streaming": False}, "source.streaming")])
def test_hub_only_keys_on_a_save_to_disk_folder_are_refused_not_ignored(given, key):
    with pytest.raises(JobError, match=f"{key} applies to hub datasets and data-file folders; .* save_to_disk folder"):
        open_source(SourceSpec(path=CHAT_DATASET, **given))


def test_a_dataset_saved_from_a_named_split_has_that_split(tmp_path):
    import datasets

    datasets.Dataset.from_list(seed_rows(4), split="validation").save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(JobError) as e:
        open_source(SourceSpec(path=str(tmp_path / "ds")))  # split defaults to train
    assert "whose one split is 'validation'; set source.split: validation" in str(e.value)
    assert open_source(SourceSpec(path=str(tmp_path / "ds"), split="validation")).num_rows == 4


def test_a_dataset_dict_folder_lists_its_splits(tmp_path):
    import datasets

    rows = seed_rows(4)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "validation": datasets.Dataset.from_list(rows)}) \
        .save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(JobError) as e:
        open_source(SourceSpec(path=str(tmp_path / "dd"), split="test"))
    assert str(e.value) == f"source.split 'test' is not a split of dataset {tmp_path / 'dd'}; splits: train, validation"


def test_a_data_file_folder_through_datasets_names_source_split(tmp_path):
    (tmp_path / "csvs").mkdir()
    (tmp_path / "csvs" / "a.csv").write_text("id,topic\n1,tea\n")
    for streaming in (True, False):
        with pytest.raises(JobError) as e:
            open_source(SourceSpec(path=str(tmp_path / "csvs"), type="hf", split="test", streaming=streaming))
        assert str(e.value).startswith("source.split 'test' is not a split of dataset")
        assert "train" in str(e.value)


@pytest.mark.parametrize("given", [{"split": "test"}, {"name": "subset"}, {"streaming": False},
                                   {"split": "validation", "name": "x"}])
@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_hf_only_source_keys_on_another_kind_of_source_are_refused_naming_them(tmp_path, given, kind):
    """source.split / name / streaming set away from their defaults for a file source would be ignored: a job
    about to run is refused, naming each key (their defaults, e.g. split: train, change nothing and pass); the
    source still opens for readers of an output begun before the check (status, export)."""
    from batchgen.sources import refuse_ignored_keys

    rows = seed_rows(3)
    if kind == "jsonl":
        path = write_jsonl(tmp_path / "rows.jsonl", rows)
    else:
        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(JobError) as e:
        refuse_ignored_keys(SourceSpec(path=str(path), **given))
    for key in given:
        assert f"source.{key}" in str(e.value)
    assert f"read as {kind}" in str(e.value)
    assert len(list(open_source(SourceSpec(path=str(path), **given)))) == 3
    refuse_ignored_keys(SourceSpec(path=str(path)))  # without them, or at their defaults: no refusal
    refuse_ignored_keys(SourceSpec(path=str(path), split="train", streaming=True, name=None))


def test_a_job_with_an_hf_only_key_on_a_file_source_is_refused_by_run_and_validate(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id", "split": "test"})
    for command in ("run", "validate"):
        result = CliRunner().invoke(app, [command, str(job), "--no-progress"] if command == "run" else
                                    [command, str(job)])
        assert result.exit_code == 2 and "source.split applies to Hugging Face datasets only" in result.output
        assert not (tmp_path / "out" / "data").exists()

"""`batchgen export`: a job's committed output as one OpenAI batch-output, JSONL or Parquet file, source order."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import write_job, write_jsonl

runner = CliRunner()
TOPICS = ["the sea", "bread", "rome", "bees", "jazz", "stars", "maps", "tea", "rain", "clocks", "owls"]


def _run(tmp_path, tiny_model_dir, chat=True):
    # keys in an order that no sort recovers: source order must come from the source; one row is rejected
    rows = [{"id": f"k-{(7 * i) % 11:02d}", "topic": t, "level": i % 3} for i, t in enumerate(TOPICS)]
    rows[4]["topic"] = None
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"n": 2, "temperature": 0.8}, prompt={"chat": chat}, output={"report": False})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    return tmp_path / "out", [r["id"] for r in rows]


def test_openai_export_has_every_custom_id_once_in_the_batch_output_shape(tmp_path, tiny_model_dir):
    out, keys = _run(tmp_path, tiny_model_dir)
    result = runner.invoke(app, ["export", str(out), "--format", "openai", "--to", str(tmp_path / "results.jsonl"),
                                 "--errors", str(tmp_path / "errors.jsonl")])
    assert result.exit_code == 0, result.output
    assert "10 lines and 1 error lines" in result.output
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [k for k in keys if k != keys[4]]  # source order
    assert [x["custom_id"] for x in errors] == [keys[4]] and errors[0]["error"]["code"] == "null_value"
    assert errors[0]["response"] is None
    first = lines[0]
    assert first["error"] is None and first["response"]["status_code"] == 200
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and len(body["choices"]) == 2
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
               and c["finish_reason"] in ("stop", "length") for c in body["choices"])
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > usage["prompt_tokens"]
    assert isinstance(body["created"], int) and body["model"].endswith("tiny-llama")


def test_openai_export_without_an_errors_file_puts_the_error_lines_in_the_same_file(tmp_path, tiny_model_dir):
    out, keys = _run(tmp_path, tiny_model_dir, chat=False)
    result = runner.invoke(app, ["export", str(out), "--format", "openai", "--to", str(tmp_path / "all.jsonl")])
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (tmp_path / "all.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(keys)  # every input row exactly once
    done = [x for x in lines if x["error"] is None]
    assert done[0]["response"]["body"]["object"] == "text_completion"
    assert "text" in done[0]["response"]["body"]["choices"][0]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_jsonl_and_parquet_exports_hold_every_completion_row_in_source_order(tmp_path, tiny_model_dir, fmt):
    out, keys = _run(tmp_path, tiny_model_dir)
    target = tmp_path / f"all.{fmt}"
    result = runner.invoke(app, ["export", str(out), "--format", fmt, "--to", str(target)])
    assert result.exit_code == 0, result.output
    rows = (pq.read_table(target).to_pylist() if fmt == "parquet" else
            [json.loads(x) for x in target.read_text().splitlines()])
    expected = [(k, s) for k in keys if k != keys[4] for s in (0, 1)]
    assert [(r["id"], r["sample_idx"]) for r in rows] == expected
    assert all(isinstance(r["completion"], str) for r in rows)


def test_export_when_the_source_is_gone_keeps_commit_order_and_says_so(tmp_path, tiny_model_dir):
    out, keys = _run(tmp_path, tiny_model_dir)
    (tmp_path / "rows.jsonl").unlink()
    result = runner.invoke(app, ["export", str(out), "--format", "jsonl", "--to", str(tmp_path / "x.jsonl")])
    assert result.exit_code == 0, result.output
    assert "rows are in commit order" in result.output
    assert len((tmp_path / "x.jsonl").read_text().splitlines()) == 20


def test_export_refuses_what_it_cannot_do_with_a_clear_message(tmp_path, tiny_model_dir):
    result = runner.invoke(app, ["export", str(tmp_path), "--format", "jsonl", "--to", str(tmp_path / "x")])
    assert result.exit_code == 2 and "not a batchgen output directory" in result.output
    out, _ = _run(tmp_path, tiny_model_dir)
    result = runner.invoke(app, ["export", str(out), "--format", "csv", "--to", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--format 'csv'" in result.output
    result = runner.invoke(app, ["export", str(out), "--format", "jsonl", "--to", str(tmp_path / "x"),
                                 "--errors", str(tmp_path / "e")])
    assert result.exit_code == 2 and "--errors is for --format openai" in result.output
    # never over what it reads: the output's own files, the job's source
    shard = sorted((out / "data").glob("*.parquet"))[0]
    before = shard.read_bytes(), (tmp_path / "rows.jsonl").read_bytes()
    for to, says in ((shard, "lies inside the output"), (out / "all.jsonl", "lies inside the output"),
                     (tmp_path / "rows.jsonl", "would write over or into the job's source")):
        result = runner.invoke(app, ["export", str(out), "--format", "jsonl", "--to", str(to)])
        assert result.exit_code == 2 and says in result.output, result.output
    result = runner.invoke(app, ["export", str(out), "--format", "openai", "--to", str(tmp_path / "ok.jsonl"),
                                 "--errors", str(shard)])
    assert result.exit_code == 2 and "--errors" in result.output and "lies inside the output" in result.output
    assert (shard.read_bytes(), (tmp_path / "rows.jsonl").read_bytes()) == before


def test_rows_whose_keys_left_the_source_come_last_once_each_with_a_notice(tmp_path, tiny_model_dir):
    out, keys = _run(tmp_path, tiny_model_dir)
    kept = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()][3:]  # 3 rows deleted
    write_jsonl(tmp_path / "rows.jsonl", kept)
    result = runner.invoke(app, ["export", str(out), "--format", "openai", "--to", str(tmp_path / "r.jsonl")])
    assert result.exit_code == 0, result.output
    assert "3 keys are no longer in the source" in result.output
    ids = [json.loads(x)["custom_id"] for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 11  # 10 completed rows and the reject, each once
    assert ids[:7] == [k for k in keys[3:] if k != keys[4]]  # the rows still in the source, in its order

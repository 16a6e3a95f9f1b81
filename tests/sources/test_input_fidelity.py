"""Input is read as written: a UTF-8 byte order mark is not part of row 0, invalid UTF-8 is a reject naming
its line (never silently replaced), and OpenAI content-part arrays of text are prompts (other parts: a named
reject); a .gz source that is no gzip file or is truncated stops the job naming the file (exit 2), never a
retry loop."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.errors import RowError
from batchgen.config import PromptSpec, SourceSpec
from batchgen.prompts import PromptRenderer
from batchgen.sources import open_source
from jobutil import read_rows

runner = CliRunner()


def _rows(path):
    return list(open_source(SourceSpec(path=str(path))))


def test_a_utf8_bom_at_the_start_of_a_jsonl_file_is_dropped_and_row_0_parses(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"id": "a", "text": "one"}\n{"id": "b", "text": "two"}\n')
    rows = _rows(path)
    assert [r.columns for r in rows] == [{"id": "a", "text": "one"}, {"id": "b", "text": "two"}]
    assert open_source(SourceSpec(path=str(path), key_column="id")).columns == ["id", "text"]


def test_invalid_utf8_in_a_jsonl_line_is_a_malformed_row_naming_the_line_not_replacement_characters(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"id": "a", "text": "fine"}\n{"id": "b", "text": "caf\xe9"}\n{"id": "c", "text": "ok"}\n')
    rows = _rows(path)
    assert rows[0].columns == {"id": "a", "text": "fine"} and rows[2].columns == {"id": "c", "text": "ok"}
    assert rows[1].columns is None
    assert f"line 2 of {path} is not valid UTF-8 (byte 24: b'\\xe9'" in rows[1].error
    assert all("\ufffd" not in json.dumps(r.columns) for r in rows if r.columns)


def _batch_job(tmp_path, model_dir, messages_per_line):
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": messages, "max_tokens": 3}} for i, messages in enumerate(messages_per_line)]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": {"path": model_dir, "device": "cpu"}, "source": {"path": "batch.jsonl"},
                                   "sampling": {"temperature": 0.0, "max_new_tokens": 4}, "output": {"dir": "out", "report": False,
                                                                                "keep_prompt": True},
                                   "engine": {"max_num_seqs": 4, "num_kv_blocks": 64, "block_size": 8}}))
    return job


def test_openai_content_part_arrays_of_text_are_joined_and_other_parts_are_named_rejects(tmp_path, tiny_model_dir):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a tale"}]}]
    plain = [{"role": "user", "content": "Tell me\na tale"}]
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]
    result = runner.invoke(app, ["run", str(_batch_job(tmp_path, tiny_model_dir, [parts, plain, image])),
                                 "--no-progress"])
    assert result.exit_code == 0, result.output
    done = {r["custom_id"]: r for r in read_rows(tmp_path / "out")}
    assert set(done) == {"r0", "r1"}
    assert done["r0"]["prompt"] == done["r1"]["prompt"] and done["r0"]["completion"] == done["r1"]["completion"]
    rejects = read_rows(tmp_path / "out", "rejects")
    assert [(r["custom_id"], r["error_class"]) for r in rejects] == [("r2", "bad_messages")]
    assert "message 0: content part 1 is of type 'image_url': only text parts" in rejects[0]["message"]


def test_a_messages_column_with_text_parts_renders_like_plain_text(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    r = PromptRenderer(PromptSpec(messages_column="messages"), tokenizer, ["messages"], 100)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert r.render({"messages": parts}) == r.render({"messages": [{"role": "user", "content": "a\nb"}]})
    with pytest.raises(RowError) as e:
        r.render({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]})
    assert e.value.error_class == "bad_messages" and "'input_audio'" in str(e.value)


def test_an_openai_batch_file_beginning_with_a_bom_is_still_recognised(tmp_path):
    from batchgen.sources.openai_batch import sniff

    path = tmp_path / "batch.jsonl"
    line = {"custom_id": "r0", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}]}}
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(line).encode() + b"\n")
    assert sniff(str(path)) == "messages"
    assert [r.columns["custom_id"] for r in open_source(SourceSpec(path=str(path), type="openai_batch"))] == ["r0"]


def test_a_lone_surrogate_escape_in_a_jsonl_line_is_a_malformed_row_and_a_pair_is_its_character(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": "a", "text": "x\\ud800y"}\n{"id": "b", "text": "\\ud83d\\ude00"}\n')
    rows = _rows(path)
    assert rows[0].columns is None and "'\\ud800', a lone UTF-16 surrogate escape" in rows[0].error
    assert rows[1].columns == {"id": "b", "text": "\U0001F600"}


@pytest.mark.parametrize("damage", ["truncated", "not_gzip"])
def test_a_corrupt_gz_source_stops_run_and_validate_with_exit_2_naming_the_file(tmp_path, tiny_model_dir, damage):
    import gzip

    from jobutil import write_job

    text = "".join(json.dumps({"id": f"r{i}", "text": f"row {i} " + "words " * 40}) + "\n" for i in range(200))
    packed = gzip.compress(text.encode())
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(packed[: len(packed) * 2 // 3] if damage == "truncated" else text.encode())
    with pytest.raises(Exception, match="rows.jsonl.gz is not a readable gzip file") as caught:
        _rows(path)
    assert type(caught.value).__name__ == "JobError"
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl.gz", "key_column": "id"},
                    sampling={"max_new_tokens": 4})
    for command in (["validate", str(job)], ["run", str(job), "--no-progress"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, result.output
        assert "rows.jsonl.gz is not a readable gzip file" in result.output


@pytest.mark.parametrize("text", ['[{"id": 1, "t": "a"}, {"id": 2, "t": "b"}]\n',
                                  '[\n  {"id": 1, "t": "a"},\n  {"id": 2, "t": "b"}\n]\n'])
def test_a_json_array_file_is_refused_saying_it_is_an_array_not_json_lines(tmp_path, text):
    """A .json file holding an array (one line, or pretty-printed: its last object's line parses alone, and the
    job ran on that one row, every other line a malformed_row reject) is named as what it is."""
    from batchgen.errors import JobError

    (tmp_path / "rows.json").write_text(text)
    (tmp_path / "first.jsonl").write_text('{"id": 0, "t": "z"}\n')
    for paths in ([str(tmp_path / "rows.json")], [str(tmp_path / "first.jsonl"), str(tmp_path / "rows.json")]):
        with pytest.raises(JobError, match=r"rows.json starts with '\[': a JSON array, where batchgen reads JSON "
                                           r"Lines"):
            open_source(SourceSpec(path=paths))

"""Chat batch lines: the source checks each message, so a line's outcome never depends on output.keep_columns. A
message's `name` is dropped (the chat template is handed role and content only) and the line is generated; tool
calls, function calls, tool results, audio and other fields a message's role and content cannot carry reject the
line as `malformed_row` naming body.messages[i].<field>; never a schema_mismatch about inferred types."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows

runner = CliRunner()
USER = {"role": "user", "content": "hi"}
TOOL_CALL = [{"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
MESSAGES = {
    "plain": [USER],
    "named": [{"role": "system", "content": "be brief", "name": "sys"}, {**USER, "name": "bob"}],
    "nulls": [{**USER, "tool_calls": None, "refusal": None, "name": None}],  # null optional fields: as absent
    "parts": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
    "tool_calls": [USER, {"role": "assistant", "content": None, "tool_calls": TOOL_CALL}, USER],
    "function_call": [USER, {"role": "assistant", "content": None, "function_call": {"name": "f"}}, USER],
    "tool_role": [USER, {"role": "tool", "content": "42", "tool_call_id": "t"}],
    "audio": [USER, {"role": "assistant", "content": "x", "audio": {"id": "a"}}],
    "null_content": [USER, {"role": "assistant", "content": None}],
    "no_role": [{"content": "hi"}],
    "odd_role": [{"role": "narrator", "content": "hi"}],
    "bad_name": [{**USER, "name": 5}],
    "not_a_message": ["hi"],
    "not_a_list": {"role": "user", "content": "hi"},
}
NAMED = {"tool_calls": "body.messages[1].tool_calls", "function_call": "body.messages[1].function_call",
         "tool_role": "body.messages[1].role", "audio": "body.messages[1].audio",
         "null_content": "body.messages[1].content", "no_role": "body.messages[0].role",
         "odd_role": "body.messages[0].role", "bad_name": "body.messages[0].name",
         "not_a_message": "body.messages[0]", "not_a_list": "body.messages holds an object"}


@pytest.mark.parametrize("keep_columns", ["all", "none"])
def test_each_message_is_checked_by_the_source_whatever_the_kept_columns(tmp_path, tiny_model_dir, keep_columns):
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(
        {"custom_id": k, "method": "POST", "url": "/v1/chat/completions", "body": {"messages": m, "max_tokens": 3}})
        + "\n" for k, m in MESSAGES.items()))
    job = {"model": {"path": tiny_model_dir, "device": "cpu"}, "source": {"path": "b.jsonl"},
           "sampling": {"max_new_tokens": 4, "temperature": 0.0},
           "engine": {"max_num_seqs": 8, "num_kv_blocks": 256, "block_size": 8},
           "output": {"dir": "out", "report": False, "keep_prompt": True, "keep_columns": keep_columns}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    result = runner.invoke(app, ["run", str(tmp_path / "job.yaml"), "--no-progress"])
    assert result.exit_code == 0, result.output
    rows = {r["custom_id"]: r for r in read_rows(tmp_path / "out")}
    assert sorted(rows) == ["named", "nulls", "parts", "plain"]
    assert rows["nulls"]["prompt"] == rows["plain"]["prompt"]  # null optional fields change nothing
    assert "bob" not in rows["named"]["prompt"] and "be brief" in rows["named"]["prompt"]  # name dropped
    assert "hi\nthere" in rows["parts"]["prompt"]
    if keep_columns == "all":  # the kept messages: {role, content} turns, name dropped
        assert rows["named"]["messages"] == [{"role": "system", "content": "be brief"}, USER]
    rejects = {r["custom_id"]: r for r in read_rows(tmp_path / "out", "rejects")}
    assert sorted(rejects) == sorted(NAMED)
    for key, field in NAMED.items():
        assert rejects[key]["error_class"] == "malformed_row", rejects[key]
        assert field in rejects[key]["message"] and "inferred" not in rejects[key]["message"], rejects[key]

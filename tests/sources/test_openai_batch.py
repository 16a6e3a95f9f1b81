"""OpenAI batch files in (`source.type: openai_batch`, inferred) and out (`batchgen export --format openai`):
per-line sampling fields, every custom_id exactly once across the results and errors files."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows

runner = CliRunner()


def _request(custom_id, body, url="/v1/chat/completions"):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _job(tmp_path, model_dir, lines):
    (tmp_path / "batch.jsonl").write_text("".join(
        (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    job = {"model": {"path": model_dir, "device": "cpu"}, "source": {"path": "batch.jsonl"},
           "sampling": {"max_new_tokens": 10, "temperature": 0.0},
           "engine": {"max_num_seqs": 8, "num_kv_blocks": 256, "block_size": 8},
           "output": {"dir": "out", "report": False}}  # no prompt section: the lines' messages
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


def test_a_chat_batch_file_runs_with_per_line_settings_and_exports_every_custom_id_once(tmp_path, tiny_model_dir):
    chat = [{"role": "user", "content": "Say something about tea."}]
    lines = [
        _request("req-a", {"model": "gpt-4o-mini", "messages": chat}),
        _request("req-b", {"model": "gpt-4o-mini", "messages": chat, "max_tokens": 3}),
        _request("req-c", {"messages": chat, "n": 2, "temperature": 0.9, "seed": 5, "max_completion_tokens": 6}),
        _request("req-d", {"messages": chat, "presence_penalty": 2.5}),  # outside OpenAI's -2..2: rejected
        _request("req-e", {"messages": chat, "stop": ["\n"], "stream": False, "user": "u1",
                           "frequency_penalty": 0.5, "presence_penalty": 0.3, "logit_bias": {}}),
        _request("req-f", {"messages": chat, "logit_bias": {"5": -100}}),  # OpenAI's token ids: rejected
        "{not json",
        _request("req-g", {"prompt": "Hello"}, url="/v1/completions"),  # another endpoint than the file's
        _request("req-h", {"messages": chat, "tools": [{"type": "function"}]}),  # unsupported: named as sent
    ]
    job = _job(tmp_path, tiny_model_dir, lines)
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    out = read_rows(tmp_path / "out")
    samples = {}
    for r in out:
        samples.setdefault(r["custom_id"], []).append(r)
    assert sorted(samples) == ["req-a", "req-b", "req-c", "req-e"]
    assert samples["req-a"][0]["num_completion_tokens"] > 3
    assert samples["req-b"][0]["num_completion_tokens"] <= 3
    assert len(samples["req-c"]) == 2 and all(r["num_completion_tokens"] <= 6 for r in samples["req-c"])
    rejects = {r["custom_id"]: r for r in read_rows(tmp_path / "out", "rejects")}
    assert rejects["req-d"]["error_class"] == "bad_sampling" and "presence_penalty" in rejects["req-d"]["message"]
    assert rejects["req-f"]["error_class"] == "bad_sampling" and "OpenAI token ids" in rejects["req-f"]["message"]
    assert rejects["req-g"]["error_class"] == "malformed_row" and "/v1/completions" in rejects["req-g"]["message"]
    assert rejects["req-h"]["error_class"] == "bad_sampling" and "body.tools" in rejects["req-h"]["message"]
    assert sum(r["error_class"] == "malformed_row" for r in rejects.values()) == 2  # the broken line too
    assert result.output.count("body.model ('gpt-4o-mini') is ignored") == 1  # once a run, not once a line

    result = runner.invoke(app, ["export", str(tmp_path / "out"), "--format", "openai", "--to",
                                 str(tmp_path / "results.jsonl"), "--errors", str(tmp_path / "errors.jsonl")])
    assert result.exit_code == 0, result.output
    assert "body.model" not in result.output  # the run said it; export only reads the file for its order
    results = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "errors.jsonl").read_text().splitlines()]
    ids = [x["custom_id"] for x in results + errors]
    assert len(ids) == len(set(ids)) == 9  # every line exactly once (the broken line by its position)
    assert [x["custom_id"] for x in results] == ["req-a", "req-b", "req-c", "req-e"]  # file order
    assert len(results[2]["response"]["body"]["choices"]) == 2


def test_a_completions_batch_file_prompts_with_the_text_and_exports_text_completions(tmp_path, tiny_model_dir):
    lines = [_request(f"c{i}", {"prompt": f"Once upon a time {i}", "max_tokens": 4}, url="/v1/completions")
             for i in range(3)]
    job = _job(tmp_path, tiny_model_dir, lines)
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert all(r["num_completion_tokens"] <= 4 for r in read_rows(tmp_path / "out"))
    result = runner.invoke(app, ["export", str(tmp_path / "out"), "--format", "openai", "--to",
                                 str(tmp_path / "r.jsonl")])
    assert result.exit_code == 0, result.output
    bodies = [json.loads(x)["response"]["body"] for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [b["object"] for b in bodies] == ["text_completion"] * 3 and "text" in bodies[0]["choices"][0]


def test_the_progress_total_is_right_for_every_source_type(tmp_path, tiny_model_dir):
    import gzip

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.config import SourceSpec
    from batchgen.sources import open_source

    rows = [{"id": f"r{i}", "topic": "tea", "level": i} for i in range(7)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n\n" for r in rows))  # blank lines do not count
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(_request(r["id"], {"messages": []})) + "\n" for r in rows))
    expected = {"a.parquet": 7, "a.jsonl": 7, "ds": 7, "b.jsonl": 7, "a.jsonl.gz": None}
    for name, total in expected.items():
        kind = {"b.jsonl": "openai_batch"}.get(name)
        source = open_source(SourceSpec(path=str(tmp_path / name), type=kind))
        assert source.progress_rows() == total, name
        assert open_source(SourceSpec(path=str(tmp_path / name), type=kind, limit=3)).progress_rows() in (3, None)
    job = _job(tmp_path, tiny_model_dir, [_request("x", {"messages": [{"role": "user", "content": "hi"}]})])
    assert runner.invoke(app, ["run", str(job), "--no-progress"]).exit_code == 0
    out = open_source(SourceSpec(path=str(tmp_path / "out")))  # an output directory: its committed rows
    assert out.progress_rows() == 1

"""`batchgen run` with log-probs: the columns exist only when asked for, hold the model's teacher-forced
log-probs, a scoring-only job (prompt_logprobs, max_new_tokens 0) writes prompt_logprobs, bad values are
refused naming the key, and a resume with a changed setting is refused."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows, seed_rows, write_job

runner = CliRunner()


def _run(job, *extra):
    return runner.invoke(app, ["run", str(job), "--no-progress", *extra])


@pytest.fixture
def parquet_job(tmp_path, tiny_model_dir):
    pq.write_table(pa.Table.from_pylist(seed_rows(7)), tmp_path / "rows.parquet")

    def make(**sections):
        return write_job(tmp_path, tiny_model_dir, {"path": "rows.parquet", "key_column": "id"}, **sections)
    return make


def _teacher_forced(model_dir: str, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_scoring_only_job_writes_prompt_logprobs_loadable_with_pyarrow(tmp_path, tiny_model_dir, parquet_job):
    job = parquet_job(sampling={"max_new_tokens": 0, "prompt_logprobs": True},
                      output={"keep_token_ids": True, "keep_prompt": True})
    result = _run(job)
    assert result.exit_code == 0, result.output
    files = sorted((tmp_path / "out" / "data").glob("*.parquet"))
    table = pa.concat_tables([pq.read_table(f) for f in files])
    assert table.schema.field("prompt_logprobs").type == pa.list_(pa.float32())
    assert "completion_logprobs" not in table.schema.names
    rows = table.to_pylist()
    assert len(rows) == 7
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for r in rows:
        assert (r["completion"], r["num_completion_tokens"], r["finish_reason"]) == ("", 0, "length")
        ids = tok.encode(r["prompt"], add_special_tokens=False)
        assert len(r["prompt_logprobs"]) == r["num_prompt_tokens"] == len(ids) and r["prompt_logprobs"][0] is None
    r = rows[0]
    ids = tok.encode(r["prompt"], add_special_tokens=False)
    assert torch.allclose(torch.tensor(r["prompt_logprobs"][1:]), _teacher_forced(tiny_model_dir, ids), atol=1e-4)


def test_logprob_columns_hold_the_sampled_tokens_logprobs_and_top_k(tmp_path, tiny_model_dir, parquet_job):
    job = parquet_job(sampling={"logprobs": 3, "n": 2, "temperature": 0.7, "top_p": 0.9},
                      output={"keep_token_ids": True, "keep_prompt": True})
    result = _run(job)
    assert result.exit_code == 0, result.output
    schema = pq.read_schema(sorted((tmp_path / "out" / "data").glob("*.parquet"))[0])
    assert schema.field("completion_logprobs").type == pa.list_(pa.float32())
    top = schema.field("completion_top_logprobs").type
    assert top == pa.list_(pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])))
    assert "prompt_logprobs" not in schema.names
    rows = read_rows(tmp_path / "out")
    assert len(rows) == 14
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r = rows[1]
    prompt = tok.encode(r["prompt"], add_special_tokens=False)
    ref = _teacher_forced(tiny_model_dir, prompt + r["completion_token_ids"])[len(prompt) - 1:]
    assert len(r["completion_logprobs"]) == r["num_completion_tokens"] == len(r["completion_top_logprobs"])
    assert torch.allclose(torch.tensor(r["completion_logprobs"]), ref, atol=1e-4)
    for pos, token, lp in zip(r["completion_top_logprobs"], r["completion_token_ids"], r["completion_logprobs"]):
        values = [p["logprob"] for p in pos]
        assert len(pos) == 3 and values == sorted(values, reverse=True)  # most likely first
        top = {p["token_id"]: p["logprob"] for p in pos}
        assert abs(top[token] - lp) < 1e-6 if token in top else lp <= values[-1] + 1e-6


def test_logprob_tokens_store_each_tokens_text_beside_its_id(tmp_path, tiny_model_dir, parquet_job):
    job = parquet_job(sampling={"logprobs": 2, "temperature": 0.7}, output={"keep_token_ids": True,
                                                                           "logprob_tokens": True})
    result = _run(job)
    assert result.exit_code == 0, result.output
    schema = pq.read_schema(sorted((tmp_path / "out" / "data").glob("*.parquet"))[0])
    assert schema.field("completion_logprob_tokens").type == pa.list_(pa.string())
    assert schema.field("completion_top_logprobs").type == pa.list_(pa.list_(pa.struct(
        [("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32())])))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for r in read_rows(tmp_path / "out"):
        assert r["completion_logprob_tokens"] == [tok.decode([i]) for i in r["completion_token_ids"]]
        assert len(r["completion_logprob_tokens"]) == len(r["completion_logprobs"])
        for pos in r["completion_top_logprobs"]:
            assert [p["token"] for p in pos] == [tok.decode([p["token_id"]]) for p in pos]
    result = _run(job, "--set", "output.logprob_tokens=false")  # other columns: a resume is refused
    assert result.exit_code == 2 and "logprob_tokens" in result.output


def test_logprob_tokens_without_logprobs_are_refused_naming_both_keys(parquet_job):
    result = _run(parquet_job(output={"logprob_tokens": True}))
    assert result.exit_code == 2 and "output.logprob_tokens" in result.output
    assert "needs sampling.logprobs" in result.output and "Traceback" not in result.output


def test_a_job_without_logprobs_keeps_todays_schema(tmp_path, parquet_job):
    assert _run(parquet_job()).exit_code == 0
    names = pq.read_schema(sorted((tmp_path / "out" / "data").glob("*.parquet"))[0]).names
    assert not {"completion_logprobs", "completion_top_logprobs", "prompt_logprobs", "reasoning",
                "num_reasoning_tokens"} & set(names)


@pytest.mark.parametrize("override,message", [
    ("sampling.logprobs=21", "'sampling.logprobs' = 21: Input should be less than or equal to 20"),
    ("sampling.logprobs=-1", "'sampling.logprobs' = -1"),
    ("sampling.max_new_tokens=0", "max_new_tokens: 0 generates nothing"),
    ("sampling.thinking_budget=4", "sampling.thinking_budget needs think markers"),
])
def test_bad_logprob_and_budget_values_are_refused_naming_the_key(parquet_job, override, message):
    result = _run(parquet_job(), "--set", override)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_resume_with_a_changed_logprobs_setting_is_refused_naming_it(parquet_job):
    job = parquet_job(sampling={"logprobs": 2})
    assert _run(job).exit_code == 0
    result = _run(job, "--set", "sampling.logprobs=4")
    assert result.exit_code == 2 and "sampling.logprobs: 2 -> 4" in result.output
    result = _run(job, "--set", "sampling.prompt_logprobs=true")
    assert result.exit_code == 2 and "sampling.prompt_logprobs: None -> True" in result.output
    assert _run(job).exit_code == 0  # unchanged: resumes (nothing left to do)


def test_an_upstream_outputs_logprob_columns_are_kept_unless_this_job_writes_its_own():
    from batchgen.config import JobSpec
    from batchgen.output.schema import OutputSchema

    upstream = pa.schema([("id", pa.string()), ("completion", pa.string()), ("prompt_logprobs", pa.list_(pa.float32())),
                          ("reasoning", pa.string())])
    base = {"model": {"path": "m"}, "source": {"path": "up", "key_column": "id"}, "prompt": {"column": "completion"}}
    plain = OutputSchema.build(JobSpec.model_validate(base), upstream)
    assert plain.kept == ("prompt_logprobs", "reasoning")  # an upstream's columns, kept as they are
    scoring = OutputSchema.build(JobSpec.model_validate({**base, "sampling": {"prompt_logprobs": True}}), upstream,
                                 reasoning=True)
    assert scoring.kept == () and scoring.data.names.count("prompt_logprobs") == 1  # this job's own win

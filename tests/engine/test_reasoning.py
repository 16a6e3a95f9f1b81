"""Reasoning output: `output.reasoning` splits a completion at its think markers (reasoning, answer,
num_reasoning_tokens), and `sampling.thinking_budget` forces the end marker after exactly N reasoning tokens.

The model is a tiny Llama made a bigram table: its attention and MLP outputs are zeroed, so the next token
depends only on the current one, and the LM head maps chosen tokens (given orthogonal embeddings) to chosen
successors: the prompt's last token -> <think> -> A -> A -> ... (never </think> by itself); </think> -> B -> EOS.
"""

from __future__ import annotations

import copy

import pytest
import torch
from typer.testing import CliRunner

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.cli import app
from batchgen.engine.reasoning import ReasoningMarkers
from conftest import make_model, make_tokenizer
from jobutil import read_rows, seed_rows, write_job, write_jsonl

runner = CliRunner()
PROMPT_TEXT = "Write about the sea."


def _think_tokenizer():
    tok = copy.deepcopy(make_tokenizer())
    tok.add_tokens(["<think>", "</think>"])
    return tok


def _ids(tok) -> dict[str, int]:
    a, b = tok.encode(" sea", add_special_tokens=False)[-1], tok.encode(" fox", add_special_tokens=False)[-1]
    last = tok.encode(PROMPT_TEXT, add_special_tokens=False)[-1]
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT_TEXT}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)
    return {"think": tok.convert_tokens_to_ids("<think>"), "end": tok.convert_tokens_to_ids("</think>"), "A": a,
            "B": b, "eos": tok.eos_token_id, "last": last, "chat_last": chat[-1]}


def _bigram_model(tok, successors: dict[int, int]):
    """A Llama whose next token is `successors[current]` for the given tokens (greedy)."""
    model = make_model("llama", vocab_size=len(tok))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hidden = model.config.hidden_size
        model.lm_head.weight.zero_()
        for axis, (src, dst) in enumerate(successors.items()):
            model.model.embed_tokens.weight[src] = torch.nn.functional.one_hot(torch.tensor(axis), hidden).float()
            model.lm_head.weight[dst, axis] = 10.0
    model.generation_config.eos_token_id = model.config.eos_token_id = tok.eos_token_id
    return model


def _chain(ids):
    return {ids["last"]: ids["think"], ids["chat_last"]: ids["think"], ids["think"]: ids["A"], ids["A"]: ids["A"],
            ids["end"]: ids["B"], ids["B"]: ids["eos"]}


@pytest.mark.parametrize("async_pipeline", [False, True])
@pytest.mark.parametrize("budget", [0, 1, 4])
def test_thinking_budget_forces_the_end_marker_after_exactly_n_reasoning_tokens(async_pipeline, budget):
    tok = _think_tokenizer()
    ids = _ids(tok)
    engine = Engine(_bigram_model(tok, _chain(ids)), tok, EngineConfig(num_kv_blocks=64, async_pipeline=async_pipeline))
    params = SamplingParams(max_new_tokens=20, temperature=0, thinking_budget=budget, logprobs=0)
    out = engine.generate([tok.encode(PROMPT_TEXT, add_special_tokens=False)], params)[0].samples[0]
    assert out.token_ids == [ids["think"], *[ids["A"]] * budget, ids["end"], ids["B"], ids["eos"]]
    assert out.finish_reason == "stop"
    assert len(out.logprobs) == len(out.token_ids)  # the forced token has its (low) log-prob too
    markers = ReasoningMarkers.auto(tok)
    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    first, end, answer = markers.split(prompt, out.token_ids)
    assert end - first == budget and out.token_ids[answer:] == [ids["B"], ids["eos"]]


def test_without_a_budget_the_model_thinks_until_max_new_tokens():
    tok = _think_tokenizer()
    ids = _ids(tok)
    engine = Engine(_bigram_model(tok, _chain(ids)), tok, EngineConfig(num_kv_blocks=64))
    out = engine.generate([tok.encode(PROMPT_TEXT, add_special_tokens=False)],
                          SamplingParams(max_new_tokens=10, temperature=0))[0].samples[0]
    assert out.token_ids == [ids["think"]] + [ids["A"]] * 9 and out.finish_reason == "length"


def test_a_prompt_that_opens_the_think_block_counts_from_the_first_generated_token():
    tok = _think_tokenizer()
    ids = _ids(tok)
    engine = Engine(_bigram_model(tok, _chain(ids)), tok, EngineConfig(num_kv_blocks=64))
    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False) + [ids["think"]]  # "<think>" ends the prompt
    out = engine.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0, thinking_budget=3))[0]
    assert out.samples[0].token_ids == [ids["A"]] * 3 + [ids["end"], ids["B"], ids["eos"]]


def test_thinking_budget_without_markers_is_an_error_naming_the_key():
    tok = make_tokenizer()  # no <think> tokens
    engine = Engine(make_model("llama", vocab_size=len(tok)), tok, EngineConfig(num_kv_blocks=16))
    with pytest.raises(ValueError, match="sampling.thinking_budget"):
        engine.add_request([5, 6, 7], SamplingParams(thinking_budget=2))


@pytest.fixture
def think_model_dir(tmp_path_factory):
    tok = _think_tokenizer()
    model = _bigram_model(tok, _chain(_ids(tok)))
    path = tmp_path_factory.mktemp("think") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), _ids(tok), tok


@pytest.mark.parametrize("reasoning", ["auto", {"start": "<think>", "end": "</think>"}])
def test_job_splits_reasoning_from_the_answer_and_the_budget_bounds_it(tmp_path, think_model_dir, reasoning):
    model_dir, ids, tok = think_model_dir
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    job = write_job(tmp_path, model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    prompt={"template": PROMPT_TEXT + "{{ topic | default('') and '' }}", "chat": True},
                    sampling={"max_new_tokens": 20, "temperature": 0, "thinking_budget": 3},
                    output={"reasoning": reasoning, "keep_token_ids": True})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    rows = read_rows(tmp_path / "out")
    assert len(rows) == 3
    a, b = tok.decode([ids["A"]]), tok.decode([ids["B"]])
    for r in rows:
        assert r["completion_token_ids"] == [ids["think"], *[ids["A"]] * 3, ids["end"], ids["B"], ids["eos"]]
        assert r["reasoning"] == a * 3 and r["completion"] == b and r["num_reasoning_tokens"] == 3
        assert r["num_completion_tokens"] == 7


def test_job_without_a_think_block_keeps_the_whole_completion(tmp_path, think_model_dir):
    model_dir, ids, tok = think_model_dir
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(2))
    # markers that neither the prompt (no chat template here) nor the completion contains
    job = write_job(tmp_path, model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    prompt={"template": PROMPT_TEXT + "{{ topic | default('') and '' }}", "chat": False},
                    sampling={"max_new_tokens": 5, "temperature": 0},
                    output={"reasoning": {"start": "<|im_end|>", "end": "</think>"}})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    for r in read_rows(tmp_path / "out"):
        assert r["reasoning"] is None and r["num_reasoning_tokens"] == 0
        assert r["completion"] == tok.decode([ids["think"]] + [ids["A"]] * 4, skip_special_tokens=True)


def test_job_thinking_budget_with_a_multi_token_end_marker_is_refused_naming_the_key(tmp_path, think_model_dir):
    model_dir, _, _ = think_model_dir
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(2))
    job = write_job(tmp_path, model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"max_new_tokens": 5, "thinking_budget": 2},
                    output={"reasoning": {"start": "<think>", "end": "END of text"}})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 2
    assert "sampling.thinking_budget needs an end marker of one token" in result.output

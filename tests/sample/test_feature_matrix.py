"""The generation controls users combine, in random combinations: every case either is refused by
SamplingParams' validation (a documented refusal) or runs to the end with every invariant below holding.

Cases are drawn from a seeded generator (MATRIX_SEED, default 0; MATRIX_CONFIGS engine configurations of
CASES_PER_CONFIG prompts each): temperature (0, 0.3-1.5), top_k, top_p, min_p, repetition / presence / frequency
penalties, logit_bias, n (1-4), seed, stop strings and stop token ids, min/max_new_tokens (0-64), logprobs /
prompt_logprobs, every response_format type, a thinking budget (prompts opening a think block), chat and plain
prompts; engines with max_num_seqs 1-16, KV caches small enough to preempt, async pipeline on and off.

Invariants, per sample: no exception and no sample that failed on its own (finish_reason error), but for a
response_format dead end (every token it allows is one of the row's stop_token_ids: a grammar_error); a completion
that finished with `stop` under a response_format is valid for it; log-probs are finite, <= 0, one per token, and
the sampled token's is the one the top-K list gives it; a stop string never appears in the text (cut before
it: finish_reason stop_string); counts and finish reasons agree with the limits; the think block ends by the
budget. The same batch on a second engine of the same configuration gives the same samples.

A failing case prints the one line that reproduces it (engine config, prompt, sampling) as JSON: paste it into
`reproduce(...)` below, or into a job's `sampling:` / `engine:` sections.
The GPU variant (`-m gpu`) runs the same cases on CUDA with the graphs and the Triton sampler on.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import random

import jsonschema
import pytest
import torch
from pydantic import ValidationError

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.engine.reasoning import ReasoningMarkers
from conftest import make_model, make_tokenizer
from feature_matrix_cases import FORMATS, MATRIX_SEED, random_sampling

MATRIX_CONFIGS = int(os.environ.get("MATRIX_CONFIGS", "12"))
CASES_PER_CONFIG = 24

PROMPTS = ["The quick brown", "Hello world! 1234", "Write a short poem about the sea.", "a", "Count: 1 2 3 4 5 6 7",
           "Describe the stars over Rome in spring, with maps and tea and owls."]


@functools.cache
def think_tokenizer():
    """The tests' tokenizer with <think> / </think> tokens (the engine finds them: a thinking budget works)."""
    tok = copy.deepcopy(make_tokenizer())
    tok.add_tokens(["<think>", "</think>"])
    return tok


@functools.cache
def matrix_model(device: str):
    torch.manual_seed(0)
    return make_model("llama", vocab_size=len(think_tokenizer()) + 7).to(device)  # padded ids: masked by grammars


def random_config(rng: random.Random, device: str) -> dict:
    config = {"max_num_seqs": rng.choice([1, 2, 3, 5, 8, 16]), "async_pipeline": rng.random() < 0.5,
              "block_size": rng.choice([4, 8, 16]), "max_num_batched_tokens": rng.choice([64, 256, 1024]),
              "enable_prefix_caching": rng.random() < 0.8}
    # a cache of ~2-6 sequences' worth: the larger batches preempt
    config["num_kv_blocks"] = rng.choice([2, 4, 6]) * (128 // config["block_size"]) + 4
    if device == "cuda":
        config["cuda_graphs"] = True
    return config


def render_prompt(rng: random.Random, tok) -> tuple[str, str]:
    """(kind, text): a plain prompt, a chat prompt, or a chat prompt that opens a think block."""
    text = rng.choice(PROMPTS)
    kind = rng.choice(["plain", "chat", "think"])
    if kind == "plain":
        return kind, text
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return kind, chat + ("<think>" if kind == "think" else "")


def draw_cases(config_idx: int, device: str):
    rng = random.Random(f"{MATRIX_SEED}:{config_idx}")
    tok = think_tokenizer()
    vocab = matrix_model(device).config.vocab_size
    config = random_config(rng, device)
    cases = []
    for _ in range(CASES_PER_CONFIG):
        kind, prompt = render_prompt(rng, tok)
        cases.append({"kind": kind, "prompt": prompt, "sampling": random_sampling(rng, vocab)})
    return config, cases


def repro_line(config: dict, case: dict) -> str:
    return json.dumps({"engine": config, "prompt": case["prompt"], "sampling": case["sampling"]})


def reproduce(line: str, device: str = "cpu"):
    """Run one case printed by a failure: reproduce('{"engine": ..., "prompt": ..., "sampling": ...}')."""
    case = json.loads(line)
    engine = Engine(matrix_model(device), think_tokenizer(), EngineConfig(**case["engine"]))
    return engine.generate([case["prompt"]], SamplingParams.model_validate(case["sampling"]))[0]


def check_sample(params: SamplingParams, prompt_ids: list[int], sample, eos: int, max_model_len: int,
                 markers: ReasoningMarkers) -> None:
    ids, text = sample.token_ids, sample.text
    if sample.finish_reason == "error":  # only a format that needs a token the row's stop_token_ids hold
        assert (sample.error_class == "grammar_error" and params.stop_token_ids and params.response_format
                and "allows no next token" in sample.error), f"the sample failed: {sample.error}"
        return
    assert len(ids) <= params.max_new_tokens
    if sample.finish_reason == "length":
        assert len(ids) == params.max_new_tokens or len(prompt_ids) + len(ids) >= max_model_len
    elif sample.finish_reason != "stop_string":  # min_new_tokens holds back EOS and stop ids, not stop strings
        assert len(ids) >= params.min_new_tokens, "ended before min_new_tokens"
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {eos})
    if sample.finish_reason == "stop":
        assert ids and (ids[-1] in stop_ids or params.response_format is not None), "stop without a stop token"
    for t in ids[:params.min_new_tokens]:
        assert t not in stop_ids, "a stop token before min_new_tokens"
    if sample.finish_reason == "stop_string":
        assert params.stop, "stop_string without stop strings"
    for stop in params.stop:
        assert stop not in text, f"stop string {stop!r} left in the text {text!r}"
    if params.response_format is not None and sample.finish_reason == "stop":
        body = text
        valid = FORMATS[params.response_format.type][1]
        try:
            ok = valid(body)
        except (ValueError, jsonschema.ValidationError) as e:
            ok = e
        assert ok is True, f"{params.response_format.type} completion {body!r} is not valid: {ok}"
    if params.logprobs is not None:
        assert len(sample.logprobs) == len(ids)
        assert all(math.isfinite(v) and v <= 1e-4 for v in sample.logprobs), sample.logprobs
        if params.logprobs > 0:
            for t, lp, top_ids, top_values in zip(ids, sample.logprobs, sample.top_logprob_ids,
                                                  sample.top_logprob_values):
                assert all(math.isfinite(v) for v in top_values)
                assert list(top_values) == sorted(top_values, reverse=True)
                assert lp <= top_values[0] + 1e-4
                if t in top_ids.tolist():
                    assert abs(top_values[top_ids.tolist().index(t)] - lp) < 1e-4, "the sampled token's log-prob"
    else:
        assert sample.logprobs is None
    if params.thinking_budget is not None and markers.opened_by(prompt_ids):
        end = markers.end_ids[0]
        assert end in ids[:params.thinking_budget + 1] or len(ids) <= params.thinking_budget, \
            f"the think block ran past its budget of {params.thinking_budget}"


def run_matrix(device: str, config_idx: int) -> dict:
    config, cases = draw_cases(config_idx, device)
    tok = think_tokenizer()
    valid, refused = [], 0
    for case in cases:
        try:
            case["params"] = SamplingParams.model_validate(case["sampling"])
            valid.append(case)
        except ValidationError:
            refused += 1  # a combination SamplingParams documents as invalid (min_new_tokens with a grammar, ...)
    prompts = [c["prompt"] for c in valid]
    params = [c["params"] for c in valid]
    runs = []
    for _ in range(2):  # the same batch on a second engine: the same samples
        engine = Engine(matrix_model(device), tok, EngineConfig(**config))
        try:
            runs.append(engine.generate(prompts, params))
        except Exception as e:
            lines = "\n".join(repro_line(config, c) for c in valid)
            raise AssertionError(f"the batch raised {type(e).__name__}: {e}; its cases:\n{lines}") from e
        max_model_len, markers = engine.max_model_len, engine.reasoning_markers
        engine.close()
    eos = tok.eos_token_id
    for case, first, second in zip(valid, *runs):
        line = repro_line(config, case)
        p = case["params"]
        try:
            assert len(first.samples) == p.n and [s.sample_idx for s in first.samples] == list(range(p.n))
            assert first.samples == second.samples, "a second engine of the same configuration sampled otherwise"
            if p.prompt_logprobs:
                lps = first.prompt_logprobs
                assert len(lps) == len(first.prompt_token_ids) and lps[0] is None
                assert all(math.isfinite(v) and v <= 1e-4 for v in lps[1:])
            for s in first.samples:
                check_sample(p, first.prompt_token_ids, s, eos, max_model_len, markers)
        except AssertionError as e:
            raise AssertionError(f"{e}\nreproduce: {line}") from None
    return {"cases": len(cases), "refused": refused}


@pytest.mark.parametrize("config_idx", range(MATRIX_CONFIGS))
def test_random_combinations_of_generation_controls_hold_every_invariant(config_idx):
    counts = run_matrix("cpu", config_idx)
    assert counts["refused"] < counts["cases"] // 2  # the draws stay mostly valid: the suite tests runs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config_idx", range(MATRIX_CONFIGS))
def test_random_combinations_hold_every_invariant_on_the_gpu_with_graphs_and_the_triton_sampler(config_idx):
    counts = run_matrix("cuda", config_idx)
    assert counts["refused"] < counts["cases"] // 2

"""The engine's greedy output is token-identical to transformers' generate, under every scheduling regime."""

from __future__ import annotations

import pytest

from batchgen import Engine, EngineConfig, SamplingParams
from conftest import ARCHS, hf_greedy, make_model, random_prompts

LENGTHS = (5, 17, 33, 8, 64, 1)
MAX_NEW = (12, 20, 7, 16, 9, 14)


def _greedy(max_new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)


def _run(model, prompts, config: EngineConfig):
    engine = Engine(model, None, config)
    results = engine.generate(prompts, [_greedy(m) for m in MAX_NEW[: len(prompts)]])
    return engine, [r.samples[0].token_ids for r in results]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_generate_per_prompt(arch):
    model = make_model(arch)
    prompts = random_prompts(LENGTHS)
    expected = [hf_greedy(model, p, m) for p, m in zip(prompts, MAX_NEW)]
    _, got = _run(model, prompts, EngineConfig(num_kv_blocks=128, block_size=8))
    assert got == expected


def test_greedy_exact_with_tiny_token_budget_chunked_prefill():
    model = make_model("llama")
    prompts = random_prompts(LENGTHS)
    expected = [hf_greedy(model, p, m) for p, m in zip(prompts, MAX_NEW)]
    engine, got = _run(model, prompts, EngineConfig(num_kv_blocks=128, block_size=4, max_num_batched_tokens=7))
    assert got == expected
    assert engine.num_steps > sum(LENGTHS) // 7  # prefill really was split over many steps


def test_greedy_exact_when_cache_is_so_small_that_requests_get_preempted():
    model = make_model("qwen2")
    prompts = random_prompts((30, 25, 28, 31, 22, 27), seed=3)
    max_new = [20] * len(prompts)
    expected = [hf_greedy(model, p, m) for p, m in zip(prompts, max_new)]
    # 14 blocks of 4 = 56 tokens: one request (<= 51 tokens) always fits, two never do for long.
    engine = Engine(model, None, EngineConfig(num_kv_blocks=14, block_size=4, enable_prefix_caching=False))
    got = [r.samples[0].token_ids for r in engine.generate(prompts, _greedy(20))]
    assert engine.scheduler.num_preemptions > 0
    assert got == expected


def test_greedy_exact_with_prefix_cache_hits():
    model = make_model("llama")
    system = random_prompts((40,), seed=7)[0]
    tails = random_prompts((3, 9, 14, 6), seed=8)
    prompts = [system + t for t in tails]
    expected = [hf_greedy(model, p, 10) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=8, max_num_seqs=1))
    results = engine.generate(prompts, _greedy(10))
    assert [r.samples[0].token_ids for r in results] == expected
    # max_num_seqs=1 serializes the prompts: every prompt after the first finds the 40-token prefix (5 blocks).
    assert [r.samples[0].num_cached_tokens for r in results] == [0, 40, 40, 40]
    assert engine.block_manager.num_prefix_hit_tokens >= 120


def test_preempted_request_resumes_from_its_own_cached_blocks_exactly():
    model = make_model("llama")
    prompts = random_prompts((30, 30, 30), seed=11)
    expected = [hf_greedy(model, p, 24) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=20, block_size=4))
    got = [r.samples[0].token_ids for r in engine.generate(prompts, _greedy(24))]
    assert engine.scheduler.num_preemptions > 0
    assert got == expected

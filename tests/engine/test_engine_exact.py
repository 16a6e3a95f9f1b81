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


def _more_archs():
    import transformers as T

    return {
        "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(head_dim=16)),
        # sliding window 16 < sequence lengths here, plus attention logit soft-capping
        "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(head_dim=16, sliding_window=16)),
        "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {}),
        "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}),
        "granite": (T.GraniteConfig, T.GraniteForCausalLM, {}),
        "starcoder2": (T.Starcoder2Config, T.Starcoder2ForCausalLM, {}),
        "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
                      dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                           num_experts_per_tok=2)),
    }


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "olmo2", "granite", "starcoder2", "qwen2_moe"])
def test_greedy_matches_transformers_on_more_architectures(arch):
    import torch

    config_cls, model_cls, extra = _more_archs()[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    prompts = random_prompts((5, 30, 12))
    expected = [hf_greedy(model, p, 24) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=8))
    got = [r.samples[0].token_ids for r in engine.generate(prompts, _greedy(24))]
    assert got == expected


@pytest.mark.parametrize("async_pipeline", [False, True])
def test_shared_prefix_is_computed_once_even_when_requests_arrive_in_the_same_step(async_pipeline):
    model = make_model("llama")
    system = random_prompts((40,), seed=7)[0]
    prompts = [system + t for t in random_prompts((3, 9, 14, 6), seed=8)]
    expected = [hf_greedy(model, p, 10) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=8, async_pipeline=async_pipeline))
    results = engine.generate(prompts, _greedy(10))  # all four admitted in the first step
    assert [r.samples[0].token_ids for r in results] == expected
    assert [r.samples[0].num_cached_tokens for r in results] == [0, 40, 40, 40]


def test_engine_config_rejects_an_unknown_graph_blas_library():
    with pytest.raises(ValueError, match="graph_blas_library"):
        EngineConfig(graph_blas_library="cublasLt")

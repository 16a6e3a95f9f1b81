"""The async pipeline (host prepares step N+1 while step N runs; placeholders carried over on the device)
gives exactly the sync engine's outputs, under every scheduling regime. On CPU it runs the same
scheduler and carry-over logic without streams."""

from __future__ import annotations

import pytest

from batchgen import Engine, EngineConfig, SamplingParams
from conftest import ARCHS, hf_greedy, make_model, make_tokenizer, random_prompts


def _both(model, prompts, params, tokenizer=None, **config):
    out = []
    for async_pipeline in (False, True):
        engine = Engine(model, tokenizer, EngineConfig(async_pipeline=async_pipeline, **config))
        out.append((engine, engine.generate(prompts, params)))
    (sync_engine, sync), (async_engine, asynced) = out
    assert [[(s.token_ids, s.text, s.finish_reason) for s in r.samples] for r in asynced] == \
        [[(s.token_ids, s.text, s.finish_reason) for s in r.samples] for r in sync]
    return async_engine, asynced


@pytest.mark.parametrize("arch", ARCHS)
def test_async_greedy_matches_transformers(arch):
    model = make_model(arch)
    prompts = random_prompts((5, 17, 33, 8, 64, 1))
    expected = [hf_greedy(model, p, 16) for p in prompts]
    _, results = _both(model, prompts, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True),
                       num_kv_blocks=128, block_size=8)
    assert [r.samples[0].token_ids for r in results] == expected


def test_async_with_chunked_prefill_preemption_and_prefix_hits():
    model = make_model("llama")
    system = random_prompts((24,), seed=7)[0]
    prompts = [system + t for t in random_prompts((3, 9, 14, 6, 20, 11), seed=8)]
    engine, _ = _both(model, prompts, SamplingParams(max_new_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
                      num_kv_blocks=22, block_size=4, max_num_batched_tokens=16)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_prefix_hit_tokens > 0


def test_async_mixed_sampling_params_n_samples_penalty_and_min_tokens():
    model = make_model("qwen3")
    prompts = random_prompts((12, 7, 30, 3, 18), seed=4)
    model.generation_config.eos_token_id = 5
    params = [SamplingParams(max_new_tokens=14, temperature=0.9, top_k=40, n=3, seed=1),
              SamplingParams(max_new_tokens=9, temperature=0, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=12, temperature=1.1, min_p=0.05, min_new_tokens=6, seed=2),
              SamplingParams(max_new_tokens=1, temperature=0),
              SamplingParams(max_new_tokens=20, temperature=0.7, top_p=0.8, stop_token_ids=(7, 11), seed=9)]
    _both(model, prompts, params, num_kv_blocks=128, block_size=8)


def test_async_stop_strings_are_detected_one_step_late_but_outputs_are_exact():
    tok = make_tokenizer()
    model = make_model("llama", vocab_size=len(tok))
    prompt = "Write a short poem about the sea."
    free = Engine(model, tok, EngineConfig(num_kv_blocks=64)).generate(
        [prompt], SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))[0].samples[0]
    stop = free.text[8:12]
    _, results = _both(model, [prompt, prompt + " Now!"], SamplingParams(max_new_tokens=40, temperature=0,
                                                                        ignore_eos=True, stop=(stop,)),
                       tokenizer=tok, num_kv_blocks=64)
    assert results[0].samples[0].finish_reason == "stop_string"


def test_async_generation_stops_at_context_length():
    model = make_model("llama", max_position_embeddings=32)
    _, results = _both(model, random_prompts((28, 20)), SamplingParams(max_new_tokens=50, temperature=0,
                                                                        ignore_eos=True), num_kv_blocks=64)
    assert [len(r.samples[0].token_ids) for r in results] == [4, 12]


def test_async_repetition_penalty_decodes_every_step_with_its_history_completed_on_the_device():
    """The in-flight token is marked in the sequence's row of the device penalty table right after its step,
    so a penalised sequence is scheduled every step (not every other step) and samples exactly what sync does."""
    import torch

    model = make_model("llama")
    with torch.no_grad():  # an echo model: the residual stream is the input embedding, read out by itself, so
        for layer in model.model.layers:  # greedy would repeat the last token unless the penalty sees it
            layer.self_attn.o_proj.weight.mul_(1e-3)
            layer.mlp.down_proj.weight.mul_(1e-3)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight * 8.0)
    prompts = random_prompts((9, 21), seed=11)
    params = [SamplingParams(max_new_tokens=24, temperature=0, repetition_penalty=4.0, ignore_eos=True),
              SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.9, repetition_penalty=4.0, seed=5,
                             ignore_eos=True)]
    engine, results = _both(model, prompts, params, num_kv_blocks=64, block_size=8)
    assert len(set(results[0].samples[0].token_ids)) > 12  # the penalty, not the echo, decided the tokens
    assert engine.num_steps <= 24 + 2  # one prefill, 23 decode steps, and the pipeline's one step of slack
    assert all(len(r.samples[0].token_ids) == 24 for r in results)


def test_repetition_penalty_survives_preemption_and_slot_reuse_and_matches_transformers():
    """Penalised sequences in a cache too small for all of them: preempted ones give their table slot back and
    send their whole history (prompt + output so far) when they return; finished ones' slots go to new
    sequences. Greedy tokens equal transformers' generate with the same repetition penalty, sync and async."""
    model = make_model("llama")
    prompts = random_prompts((9, 21, 14, 30, 5, 17), seed=3)
    expected = [hf_greedy(model, p, 20, repetition_penalty=1.8) for p in prompts]
    params = SamplingParams(max_new_tokens=20, temperature=0, repetition_penalty=1.8, ignore_eos=True)
    engine, results = _both(model, prompts, params, num_kv_blocks=12, block_size=8, max_num_seqs=4)
    assert engine.scheduler.num_preemptions > 0
    assert [r.samples[0].token_ids for r in results] == expected

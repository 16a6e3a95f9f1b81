"""Seeded sampling, stop conditions, n samples and oversize requests through the whole engine."""

from __future__ import annotations

import pytest

from batchgen import Engine, EngineConfig, SamplingParams
from conftest import hf_greedy, make_model, make_tokenizer, random_prompts


def _engine(model, tokenizer=None, **kw):
    return Engine(model, tokenizer, EngineConfig(**{"num_kv_blocks": 256, "block_size": 8, **kw}))


def test_seeded_sampling_gives_same_tokens_alone_in_a_batch_and_in_any_order():
    model = make_model("llama")
    target = random_prompts((21,), seed=5)[0]
    others = random_prompts((3, 40, 11, 27, 8, 16, 33), seed=6)
    params = SamplingParams(max_new_tokens=24, temperature=0.9, top_k=60, top_p=0.95, min_p=0.01, seed=1234,
                            ignore_eos=True)
    other_params = [SamplingParams(max_new_tokens=5 + i, temperature=1.2, seed=i, ignore_eos=True)
                    for i in range(len(others))]
    alone = _engine(model).generate([target], params)[0].samples[0].token_ids
    batched = _engine(model).generate(others + [target], other_params + [params])[-1].samples[0].token_ids
    first = _engine(model, max_num_batched_tokens=16).generate([target] + others[::-1],
                                                              [params] + other_params[::-1])[0].samples[0].token_ids
    assert alone == batched == first
    assert len(alone) == 24
    # and the seed matters
    other_seed = SamplingParams(**{**params.__dict__, "seed": 99})
    assert _engine(model).generate([target], other_seed)[0].samples[0].token_ids != alone


def test_n_samples_share_the_prompt_blocks_and_are_reproducible():
    model = make_model("llama")
    prompt = random_prompts((35,), seed=9)[0]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=4, seed=7, ignore_eos=True)
    engine = _engine(model)
    result = engine.generate([prompt], params)[0]
    assert [s.sample_idx for s in result.samples] == [0, 1, 2, 3]
    assert len({s.seed for s in result.samples}) == 4
    assert len({tuple(s.token_ids) for s in result.samples}) > 1  # different seeds, different samples
    # siblings reuse the 4 full prompt blocks (32 tokens) computed by sample 0
    assert [s.num_cached_tokens for s in result.samples] == [0, 32, 32, 32]
    again = _engine(model).generate([prompt], params)[0]
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in result.samples]
    # greedy n=3: three copies of transformers' greedy output
    greedy = _engine(model).generate([prompt], SamplingParams(max_new_tokens=12, temperature=0, n=3,
                                                              ignore_eos=True))[0]
    assert [s.token_ids for s in greedy.samples] == [hf_greedy(model, prompt, 12)] * 3


def test_n_samples_of_one_token_all_finish():
    """A leader that finishes at its first token (max_new_tokens 1, or EOS first) still starts its siblings:
    they were once never queued and generate() stepped forever."""
    model = make_model("llama")
    prompt = random_prompts((35,), seed=9)[0]
    engine = _engine(model)
    engine.add_request(prompt, SamplingParams(max_new_tokens=1, temperature=1.0, n=3, seed=7, ignore_eos=True))
    results = []
    for _ in range(20):  # stepped by hand, not generate(): the bug made it spin forever
        results += engine.step()
        if not engine.has_unfinished:
            break
    assert not engine.has_unfinished and engine.num_steps <= 4
    assert [len(s.token_ids) for s in results[0].samples] == [1, 1, 1]


def test_an_engine_that_could_never_finish_says_so_instead_of_stepping_forever(monkeypatch):
    """With the siblings of an n > 1 request lost (the bug above, put back), step() raises once nothing is left to
    run, after returning what did finish."""
    from batchgen.engine.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_release_followers", lambda self, req: None)
    engine = _engine(make_model("llama"))
    engine.add_request(random_prompts((9,), seed=2)[0], SamplingParams(max_new_tokens=2, n=2, ignore_eos=True))
    with pytest.raises(RuntimeError, match="engine stuck: 1 prompt"):
        for _ in range(20):
            engine.step()
    # a prompt that failed at admission (too long for the cache) is a result, not a stuck engine
    monkeypatch.undo()
    engine = _engine(make_model("llama"))
    engine.add_request(list(range(3, 3000)), SamplingParams(max_new_tokens=2))
    assert engine.step()[0].samples[0].finish_reason == "error" and not engine.has_unfinished


def test_stop_string_ends_the_sample_and_is_excluded_from_the_text():
    tok = make_tokenizer()
    model = make_model("llama", vocab_size=len(tok))
    prompt = "Write a short poem about the sea."
    free = _engine(model, tok).generate([prompt], SamplingParams(max_new_tokens=40, temperature=0,
                                                                 ignore_eos=True))[0].samples[0]
    assert len(free.text) > 12
    stop = free.text[8:12]
    cut = free.text.find(stop)
    result = _engine(model, tok).generate([prompt], SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True,
                                                                   stop=(stop, "NEVER-THERE")))[0].samples[0]
    assert result.finish_reason == "stop_string"
    assert result.text == free.text[:cut]
    assert len(result.token_ids) < len(free.token_ids)
    assert result.token_ids == free.token_ids[: len(result.token_ids)]


def test_eos_stops_and_min_new_tokens_suppresses_it():
    model = make_model("llama")
    prompt = random_prompts((12,), seed=2)[0]
    free = _engine(model).generate([prompt], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    tokens = free[0].samples[0].token_ids
    eos = tokens[3]
    first_eos = tokens.index(eos)
    model.generation_config.eos_token_id = eos
    stopped = _engine(model).generate([prompt], SamplingParams(max_new_tokens=20, temperature=0))[0].samples[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == tokens[: first_eos + 1]
    held = _engine(model).generate([prompt], SamplingParams(max_new_tokens=20, min_new_tokens=8,
                                                            temperature=0))[0].samples[0]
    assert eos not in held.token_ids[:8] and len(held.token_ids) >= 8
    as_stop_id = _engine(model).generate([prompt], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True,
                                                                  stop_token_ids=(eos,)))[0].samples[0]
    assert as_stop_id.finish_reason == "stop" and as_stop_id.token_ids == tokens[: first_eos + 1]


def test_max_new_tokens_gives_finish_reason_length():
    model = make_model("mistral")
    result = _engine(model).generate(random_prompts((6, 9)), [
        SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_new_tokens=13, temperature=0.5, ignore_eos=True)])
    assert [len(r.samples[0].token_ids) for r in result] == [1, 13]
    assert {r.samples[0].finish_reason for r in result} == {"length"}


def test_request_too_long_for_context_or_cache_fails_alone_with_reason():
    model = make_model("llama", max_position_embeddings=64)
    ok, too_long_prompt, too_big_for_cache = random_prompts((10, 70, 20), seed=4)
    engine = _engine(model, num_kv_blocks=6, block_size=4)  # cache holds 24 tokens
    results = engine.generate([ok, too_long_prompt, too_big_for_cache],
                              SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    assert results[0].samples[0].finish_reason == "length" and len(results[0].samples[0].token_ids) == 8
    bad_ctx, bad_cache = results[1].samples[0], results[2].samples[0]
    assert bad_ctx.finish_reason == "error" and "70 tokens" in bad_ctx.error and "context is 64" in bad_ctx.error
    assert bad_cache.finish_reason == "error" and "KV blocks" in bad_cache.error
    assert bad_ctx.token_ids == [] and bad_cache.token_ids == []


def test_generation_stops_at_the_models_context_length():
    model = make_model("llama", max_position_embeddings=32)
    result = _engine(model).generate(random_prompts((28,)), SamplingParams(max_new_tokens=50, temperature=0,
                                                                           ignore_eos=True))[0].samples[0]
    assert result.finish_reason == "length" and len(result.token_ids) == 4


def test_text_prompts_are_tokenized_and_outputs_decoded(tokenizer):
    model = make_model("qwen3", vocab_size=len(tokenizer))
    prompts = ["Hello world!", "Explain photosynthesis to a child."]
    results = _engine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=6, temperature=0,
                                                                        ignore_eos=True))
    for prompt, r in zip(prompts, results):
        assert r.prompt_token_ids == tokenizer.encode(prompt)
        assert r.samples[0].token_ids == hf_greedy(model, r.prompt_token_ids, 6)
        assert r.samples[0].text == tokenizer.decode(r.samples[0].token_ids, skip_special_tokens=True)


def test_per_prompt_params_must_match_prompt_count():
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        _engine(make_model("llama")).generate([[5, 6]], [SamplingParams(), SamplingParams()])

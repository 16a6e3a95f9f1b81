"""Completion and prompt log-probs are the model's own fp32 log_softmax, computed teacher-forced by transformers
over prompt + completion, under every scheduling regime: greedy and sampled, n > 1, chunked prefill,
preemption, prefix-cache hits, the async pipeline."""

from __future__ import annotations

import pytest
import torch

from batchgen import Engine, EngineConfig, SamplingParams
from conftest import make_model, random_prompts

TOL = 1e-4


def _reference(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[len(prompt) + len(completion) - 1, V] fp32 log_softmax: row i scores token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _check_sample(model, prompt, sample, k: int) -> None:
    ref = _reference(model, prompt, sample.token_ids)
    rows = ref[len(prompt) - 1:]
    ids = torch.tensor(sample.token_ids)
    assert len(sample.logprobs) == len(sample.token_ids)
    assert torch.allclose(torch.tensor(sample.logprobs), rows.gather(1, ids[:, None])[:, 0], atol=TOL)
    if k == 0:
        assert sample.top_logprobs is None
        return
    values, top_ids = rows.topk(k, dim=-1)
    assert [[t for t, _ in pos] for pos in sample.top_logprobs] == top_ids.tolist()
    assert torch.allclose(torch.tensor([[v for _, v in pos] for pos in sample.top_logprobs]), values, atol=TOL)


def _check_prompt(model, prompt, result) -> None:
    ref = _reference(model, prompt, [])
    expected = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    assert torch.allclose(torch.tensor(result.prompt_logprobs[1:]), expected, atol=TOL)


def _generate(model, prompts, params, **config):
    engine = Engine(model, None, EngineConfig(**{"num_kv_blocks": 128, "block_size": 8, **config}))
    return engine, engine.generate(prompts, params)


@pytest.mark.parametrize("async_pipeline", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_completion_and_prompt_logprobs_equal_transformers_teacher_forced(sampled, async_pipeline):
    model = make_model("llama")
    prompts = random_prompts((5, 17, 33, 2))
    params = SamplingParams(max_new_tokens=9, temperature=0.7 if sampled else 0.0, top_p=0.9, seed=4,
                            ignore_eos=True, logprobs=5, prompt_logprobs=True, n=2)
    _, results = _generate(model, prompts, params, async_pipeline=async_pipeline)
    for prompt, result in zip(prompts, results):
        _check_prompt(model, prompt, result)
        assert len(result.samples) == 2
        for sample in result.samples:
            _check_sample(model, prompt, sample, 5)
    if sampled:  # the samples really differ: the log-probs follow each one's own tokens
        assert any(r.samples[0].token_ids != r.samples[1].token_ids for r in results)


@pytest.mark.parametrize("async_pipeline", [False, True])
def test_logprobs_exact_when_prompts_span_many_prefill_chunks(async_pipeline):
    model = make_model("qwen2")
    prompts = random_prompts((30, 23, 41), seed=5)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=True)
    engine, results = _generate(model, prompts, params, block_size=4, max_num_batched_tokens=7,
                                async_pipeline=async_pipeline)
    assert engine.num_steps > sum(len(p) for p in prompts) // 7  # every prompt was split over several steps
    for prompt, result in zip(prompts, results):
        _check_prompt(model, prompt, result)
        _check_sample(model, prompt, result.samples[0], 3)


@pytest.mark.parametrize("async_pipeline", [False, True])
def test_logprobs_exact_and_complete_when_requests_get_preempted(async_pipeline):
    model = make_model("llama")
    prompts = random_prompts((30, 25, 28, 31, 22), seed=3)
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=2, ignore_eos=True, logprobs=2,
                            prompt_logprobs=True)
    # 14 blocks of 4 = 56 tokens: one request always fits, two never do for long
    engine, results = _generate(model, prompts, params, num_kv_blocks=14, block_size=4, max_num_batched_tokens=16,
                                async_pipeline=async_pipeline)
    assert engine.scheduler.num_preemptions > 0
    for prompt, result in zip(prompts, results):
        _check_prompt(model, prompt, result)
        _check_sample(model, prompt, result.samples[0], 2)


def test_prompt_logprobs_are_computed_not_served_from_the_prefix_cache():
    model = make_model("llama")
    system = random_prompts((40,), seed=7)[0]
    prompts = [system + t for t in random_prompts((3, 9, 14), seed=8)]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    engine, results = _generate(model, prompts, params, max_num_seqs=1)
    for prompt, result in zip(prompts, results):
        _check_prompt(model, prompt, result)
        assert result.samples[0].num_cached_tokens == 0  # the shared 40 tokens were scored again
    plain = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    again = engine.generate([prompts[0]], plain)[0]
    assert again.samples[0].num_cached_tokens == 40 and again.prompt_logprobs is None  # others still hit


def test_siblings_share_the_prompts_logprobs_and_reuse_its_cached_blocks():
    model = make_model("llama")
    prompt = random_prompts((35,), seed=9)[0]
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=1, ignore_eos=True, prompt_logprobs=True,
                            logprobs=0, n=3)
    _, (result,) = _generate(model, [prompt], params)
    _check_prompt(model, prompt, result)
    assert [s.num_cached_tokens for s in result.samples] == [0, 32, 32]
    for s in result.samples:
        _check_sample(model, prompt, s, 0)


@pytest.mark.parametrize("async_pipeline", [False, True])
def test_scoring_only_with_zero_new_tokens_scores_every_prompt_and_generates_nothing(async_pipeline):
    model = make_model("llama")
    prompts = random_prompts((12, 1, 30), seed=2)
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=True, n=2)
    _, results = _generate(model, prompts, params, block_size=4, max_num_batched_tokens=9,
                           async_pipeline=async_pipeline)
    for prompt, result in zip(prompts, results):
        _check_prompt(model, prompt, result)
        assert [(s.token_ids, s.finish_reason) for s in result.samples] == [([], "length")] * 2


def test_rows_without_logprobs_get_none_beside_rows_with_them():
    model = make_model("llama")
    prompts = random_prompts((6, 9), seed=1)
    params = [SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True, logprobs=4),
              SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)]
    _, (with_lp, without) = _generate(model, prompts, params)
    _check_sample(model, prompts[0], with_lp.samples[0], 4)
    assert without.samples[0].logprobs is None and without.samples[0].top_logprobs is None
    assert without.prompt_logprobs is None


@pytest.mark.parametrize("values,key", [
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(logprobs=True), "logprobs takes K"),
])
def test_bad_logprob_settings_raise_naming_the_key(values, key):
    with pytest.raises(ValueError, match=key):
        SamplingParams(**values)


def test_logprobs_exact_through_transformers_modules_when_the_fused_decoder_is_off():
    model = make_model("llama")
    prompts = random_prompts((19, 7), seed=6)
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=True)
    engine, results = _generate(model, prompts, params, block_size=4, max_num_batched_tokens=8, fused_decoder=False)
    assert not engine.runner.decode_forward.has_packed  # prefill steps ran transformers' forward (logits_to_keep)
    for prompt, result in zip(prompts, results):
        _check_prompt(model, prompt, result)
        _check_sample(model, prompt, result.samples[0], 2)


def test_samples_compare_by_value_with_their_top_logprob_arrays():
    import numpy as np

    from batchgen.engine.results import Sample

    def sample(value: float) -> Sample:
        return Sample(0, [1, 2], "ab", "length", 7, 0, logprobs=[-0.5, -1.0],
                      top_logprob_ids=np.array([[1, 3], [2, 4]], np.int32),
                      top_logprob_values=np.array([[-0.5, -2.0], [-1.0, value]], np.float32))

    assert sample(-3.0) == sample(-3.0) and sample(-3.0) != sample(-4.0)
    assert sample(-3.0).top_logprobs == [[(1, -0.5), (3, -2.0)], [(2, -1.0), (4, -3.0)]]

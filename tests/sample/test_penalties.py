"""Presence and frequency penalties and logit bias (OpenAI's definitions, as vLLM applies them): on the logits,
and through the engine against transformers' generate with the same rule as a logits processor."""

from __future__ import annotations

import pytest
import torch

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.engine.batch import SeqSampling
from batchgen.sample.penalty import PenaltyTable
from batchgen.sample.sampler import SamplingTensors, apply_penalties
from conftest import make_model, random_prompts


def _row(history, num_prompt, slot, repetition=1.0, presence=0.0, frequency=0.0, bias=()):
    params = SamplingParams(temperature=0, repetition_penalty=repetition, presence_penalty=presence,
                            frequency_penalty=frequency, logit_bias=tuple(bias))
    return SeqSampling(params, seed=0, penalty_slot=slot, penalty_history=history, penalty_num_prompt=num_prompt)


def _expected(logits, history, num_prompt, repetition=1.0, presence=0.0, frequency=0.0, bias=()):
    x = logits.clone()
    for t, b in bias:
        x[t] += b
    for t in set(history):  # repetition: prompt and output
        x[t] = x[t] * repetition if x[t] < 0 else x[t] / repetition
    output = list(history[num_prompt:])
    for t in set(output):  # frequency and presence: output only
        x[t] = x[t] - frequency * output.count(t) - presence
    return x


def test_penalised_logits_follow_openais_definition_and_prompt_tokens_do_not_count():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 40, generator=g)
    cases = [dict(history=(3, 7, 7, 12, 7, 9, 9, 3), num_prompt=3, presence=0.4, frequency=0.7),
             dict(history=(1, 2, 5, 5, 5), num_prompt=2, repetition=1.6, presence=-0.5, frequency=1.1,
                  bias=((5, 2.0), (30, -100.0))),
             dict(history=(0, 39), num_prompt=2, frequency=2.0)]  # nothing generated yet: no additive penalty
    rows = [_row(slot=i, **c) for i, c in enumerate(cases)]
    st = SamplingTensors.build(rows, [0] * 3, 40, logits.device, penalty_table=PenaltyTable(3, 40, logits.device))
    got = apply_penalties(logits, st)
    for i, c in enumerate(cases):
        torch.testing.assert_close(got[i], _expected(logits[i], **c), atol=1e-6, rtol=0)
    assert torch.equal(got[2], logits[2])


def test_counts_grow_on_the_device_with_each_sampled_token_and_reinitialise_with_a_new_owner():
    table = PenaltyTable(2, 10, torch.device("cpu"))
    rows = [_row((4, 4, 6), 2, slot=0, frequency=1.0), _row((1,), 1, slot=1, presence=1.0)]
    SamplingTensors.build(rows, [0, 0], 10, torch.device("cpu"), penalty_table=table)
    assert table.counts[0, 4].item() == 1 and table.counts[0, 6].item() == 2  # prompt bit; one output occurrence
    table.record(torch.tensor([0, 1, 2, 2]), torch.tensor([6, 1, 3, 3]))  # the scratch row (2) twice
    assert table.counts[0, 6].item() == 4 and table.counts[1, 1].item() == 3 and table.counts[2, 3].item() == 4
    SamplingTensors.build([_row((9,), 1, slot=0, presence=1.0)], [0], 10, torch.device("cpu"), penalty_table=table)
    assert table.counts[0].tolist() == [0] * 9 + [1]  # the slot's next owner starts from its own history


class _OpenAIPenalties:
    """transformers logits processor with OpenAI's presence / frequency penalties and logit bias."""

    def __init__(self, num_prompt: int, presence: float, frequency: float, bias: dict[int, float]):
        self.num_prompt, self.presence, self.frequency, self.bias = num_prompt, presence, frequency, bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for t, b in self.bias.items():
            scores[:, t] += b
        for row in range(scores.shape[0]):
            output = input_ids[row, self.num_prompt:].tolist()
            for t in set(output):
                scores[row, t] = scores[row, t] - self.frequency * output.count(t) - self.presence
        return scores


def _hf(model, prompt, new_tokens, presence, frequency, bias):
    from transformers import LogitsProcessorList

    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([_OpenAIPenalties(len(prompt), presence, frequency,
                                                                                    bias)]))
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("async_pipeline", [False, True])
def test_greedy_with_presence_frequency_and_bias_matches_transformers_through_preemption(async_pipeline):
    model = make_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:  # an echoing model: without the penalties it repeats itself
            layer.mlp.down_proj.weight.mul_(0.1)
    prompts = random_prompts((9, 21, 14, 30, 5, 17), seed=3)
    bias = {5: 3.0, 11: -100.0}
    expected = [_hf(model, p, 20, 0.6, 0.9, bias) for p in prompts]
    params = SamplingParams(max_new_tokens=20, temperature=0, presence_penalty=0.6, frequency_penalty=0.9,
                            logit_bias=bias, ignore_eos=True)
    engine = Engine(model, None, EngineConfig(num_kv_blocks=12, block_size=8, max_num_seqs=4,
                                              async_pipeline=async_pipeline))
    got = [r.samples[0].token_ids for r in engine.generate(prompts, params)]
    assert engine.scheduler.num_preemptions > 0
    assert got == expected
    assert all(11 not in t for t in got)
    plain = [r.samples[0].token_ids for r in Engine(model, None, EngineConfig(num_kv_blocks=64)).generate(
        prompts, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))]
    assert plain != got  # the penalties changed what was generated


def test_logit_bias_outside_the_vocabulary_is_refused_naming_the_key():
    engine = Engine(make_model("llama"), None, EngineConfig(num_kv_blocks=8))
    with pytest.raises(ValueError, match=r"logit_bias: token ids \[100000\] are outside the model's vocabulary"):
        engine.add_request([1, 2, 3], SamplingParams(logit_bias={100000: 1.0}))
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=3.0)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


def test_sampling_params_stay_hashable_and_take_logit_bias_as_a_mapping_with_string_keys():
    a = SamplingParams(logit_bias={"12": -5, 3: 1.5})  # JSON object keys are strings
    assert a.logit_bias == ((3, 1.5), (12, -5.0)) and hash(a) == hash(SamplingParams(logit_bias={3: 1.5, 12: -5}))
    with pytest.raises(ValueError, match="stop_token_ids are token ids"):
        SamplingParams(stop_token_ids=(-1,))
    with pytest.raises(ValueError, match="logit_bias keys are token ids, got 'the'"):
        SamplingParams(logit_bias={"the": 1.0})

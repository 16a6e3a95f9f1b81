"""Structured output in the engine (tiny random models, the tests' tiny byte-level tokenizer): the grammar's
bitmask really decides every sampled token, greedy and sampled, n > 1, sync and async (deferred sampling) alike;
rows end where the grammar does (finish_reason stop) or say length when cut; preemption keeps each matcher
consistent; unconstrained rows and the raw log-probs are unaffected."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.sample.grammar_mask import allowed_tokens, apply_token_bitmask
from batchgen.sampling_params import ResponseFormat
from conftest import make_model, make_tokenizer

REGEX = "(fox|dog|sea)( (fox|dog|sea)){1,3} [0-9]{2,4}"
# (no maxLength on the string: xgrammar 0.2.9 lets such strings hold raw control characters, invalid JSON)
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "kind": {"enum": ["a", "b"]},
                                           "items": {"type": "array", "items": {"type": "integer", "maximum": 9},
                                                     "maxItems": 3}},
          "required": ["word", "count", "kind", "items"]}


@pytest.fixture(scope="module")
def model():
    return make_model("llama", vocab_size=512)  # wider than the tokenizer (~400): padded ids must stay masked


def _engine(model, async_pipeline: bool, **config) -> Engine:
    return Engine(model, make_tokenizer(), EngineConfig(async_pipeline=async_pipeline, **config))


def _texts(results):
    return [[(s.token_ids, s.text, s.finish_reason) for s in r.samples] for r in results]


PROMPTS = ["The quick brown", "Hello world! 1234", "Write a short poem about the sea."]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_mask_decides_every_token_sync_and_async_alike(model, temperature):
    params = SamplingParams(max_new_tokens=40, temperature=temperature, n=2, seed=5,
                            response_format=ResponseFormat(type="regex", regex=REGEX))
    runs = [_engine(model, a, num_kv_blocks=64, block_size=8).generate(PROMPTS, params) for a in (False, True)]
    assert _texts(runs[0]) == _texts(runs[1])
    eos = make_tokenizer().eos_token_id
    for r in runs[0]:
        for s in r.samples:
            assert s.finish_reason == "stop" and s.token_ids[-1] == eos
            assert re.fullmatch(REGEX, s.text), s.text
            assert max(s.token_ids) < len(make_tokenizer())


def test_unconstrained_model_does_not_follow_the_regex_by_itself(model):
    """The constraint is the mask's doing: without it the same prompts give other text."""
    results = _engine(model, False).generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=0))
    assert not any(re.fullmatch(REGEX, r.samples[0].text) for r in results)


def test_json_schema_completions_validate_with_jsonschema(model):
    params = SamplingParams(max_new_tokens=80, temperature=1.0, n=2, seed=1,
                            response_format=ResponseFormat(type="json_schema", json_schema=SCHEMA))
    for async_pipeline in (False, True):
        for r in _engine(model, async_pipeline).generate(PROMPTS, params):
            for s in r.samples:
                assert s.finish_reason == "stop", s.text
                jsonschema.validate(json.loads(s.text), SCHEMA)


def test_choice_gives_only_the_labels(model):
    labels = ("positive", "negative", 'ne"utral ü')
    params = SamplingParams(max_new_tokens=20, temperature=1.0, n=3, seed=2,
                            response_format=ResponseFormat(type="choice", choices=labels))
    results = _engine(model, True).generate(PROMPTS, params)
    assert {s.text for r in results for s in r.samples} <= set(labels)
    assert all(s.finish_reason == "stop" for r in results for s in r.samples)


def test_grammar_completion_finishes_the_row_without_a_stop_token(model):
    """ignore_eos: the grammar has no stop token, so the row ends the moment its grammar is complete."""
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True,
                            response_format=ResponseFormat(type="grammar", grammar='root ::= "fox " [0-9] [0-9]'))
    for async_pipeline in (False, True):
        (r,) = _engine(model, async_pipeline).generate(PROMPTS[:1], params)
        s = r.samples[0]
        assert s.finish_reason == "stop" and re.fullmatch(r"fox [0-9]{2}", s.text)
        assert make_tokenizer().eos_token_id not in s.token_ids


def test_constrained_completion_cut_by_max_new_tokens_says_length(model):
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3,
                            response_format=ResponseFormat(type="regex", regex="[a-z]{30,40}"))
    for async_pipeline in (False, True):
        (r,) = _engine(model, async_pipeline).generate(PROMPTS[:1], params)
        s = r.samples[0]
        assert s.finish_reason == "length" and len(s.token_ids) == 4 and re.fullmatch("[a-z]+", s.text)


def test_preempted_constrained_rows_keep_matchers_consistent(model):
    """A KV cache too small for every row preempts some mid-completion: they recompute their KV, keep their
    tokens and matcher, and end exactly as in a roomy cache."""
    prompts = [p * 3 for p in PROMPTS] + ["Explain photosynthesis to a child. " * 2]
    params = SamplingParams(max_new_tokens=60, temperature=1.0, n=2, seed=4,
                            response_format=ResponseFormat(type="json_schema", json_schema=SCHEMA))
    roomy = _engine(model, False).generate(prompts, params)
    for async_pipeline in (False, True):
        tight = _engine(model, async_pipeline, num_kv_blocks=40, block_size=4, max_num_batched_tokens=32)
        assert _texts(tight.generate(prompts, params)) == _texts(roomy)
        assert tight.scheduler.num_preemptions > 0


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(model):
    free = SamplingParams(max_new_tokens=16, temperature=1.0, seed=9)
    alone = _engine(model, True).generate(PROMPTS, free)
    constrained = SamplingParams(max_new_tokens=16, temperature=1.0, seed=9,
                                 response_format=ResponseFormat(type="regex", regex=REGEX))
    mixed = _engine(model, True).generate(PROMPTS * 2, [free] * 3 + [constrained] * 3)
    assert _texts(mixed[:3]) == _texts(alone)
    assert all(re.fullmatch(REGEX, r.samples[0].text) for r in mixed[3:])


def test_logprobs_under_a_grammar_are_the_models_raw_distribution(model):
    prompt = make_tokenizer().encode(PROMPTS[0])
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=6, logprobs=0,
                            response_format=ResponseFormat(type="regex", regex=REGEX))
    (r,) = _engine(model, True).generate([prompt], params)
    s = r.samples[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + s.token_ids])).logits[0].float()
    raw = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1].gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(s.logprobs), raw, atol=1e-4)


def test_compiled_once_per_distinct_format(model):
    engine = _engine(model, False)
    rf = ResponseFormat(type="regex", regex=REGEX)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, n=2, response_format=rf))
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, response_format=ResponseFormat(type="regex", regex=REGEX)))
    assert engine._grammars.num_compiled == 1


def test_invalid_format_is_refused_naming_the_field(model):
    with pytest.raises(ValueError, match=r"sampling.response_format.regex: xgrammar cannot use it: .*Unclosed"):
        _engine(model, False).add_request("hi", SamplingParams(response_format=ResponseFormat(type="regex",
                                                                                              regex="[ab")))
    with pytest.raises(ValueError, match="type regex takes regex, not choices"):
        ResponseFormat(type="regex", regex="a", choices=("b",))
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=2, response_format=ResponseFormat(type="json_object"))


def test_torch_bitmask_apply_equals_xgrammars_and_keeps_raw_logits():
    import xgrammar

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=g)
    raw = logits.clone()
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 3), generator=g, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([0, 2, 4])
    out = apply_token_bitmask(logits, rows, bitmask)
    expected = logits.clone()
    full = torch.full((5, 3), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgrammar.apply_token_bitmask_inplace(expected, full, vocab_size=70, indices=rows.tolist())
    assert torch.equal(out, expected) and torch.equal(logits, raw)
    assert torch.equal(allowed_tokens(bitmask, 70), torch.isfinite(out[rows]))


def test_a_stop_token_id_that_is_text_ends_a_constrained_row_only_where_the_format_may_end(model):
    """'7' is a stop id and biased up: it is masked while the format needs more digits, then ends the row; the
    text holds the format's match, without the stop token (as EOS and stop strings are never text)."""
    tok = make_tokenizer()
    seven = tok.convert_tokens_to_ids("7")
    params = SamplingParams(max_new_tokens=20, temperature=0.9, n=3, seed=1, stop_token_ids=[seven],
                            logit_bias={seven: 100.0}, response_format=ResponseFormat(type="regex", regex="[0-9]{3}"))
    for async_pipeline in (False, True):
        for s in _engine(model, async_pipeline, num_kv_blocks=64, block_size=8).generate(PROMPTS, params)[0].samples:
            assert s.finish_reason == "stop" and s.token_ids[-1] == seven, s
            assert re.fullmatch("[0-9]{3}", s.text) and s.text == tok.decode(s.token_ids[:-1]), s.text


def test_a_format_whose_next_tokens_are_all_stop_ids_fails_that_row_alone_with_a_clear_message(model):
    tok = make_tokenizer()
    y_tokens = sorted(i for t, i in tok.get_vocab().items() if t.startswith("y"))  # every way to start "yes"
    stuck = SamplingParams(max_new_tokens=8, temperature=0.8, stop_token_ids=y_tokens,
                           response_format=ResponseFormat(type="choice", choices=("yes",)))
    fine = SamplingParams(max_new_tokens=8, temperature=0.8, response_format=ResponseFormat(type="choice",
                                                                                          choices=("yes",)))
    for async_pipeline in (False, True):
        bad, good = _engine(model, async_pipeline, num_kv_blocks=64, block_size=8).generate(
            PROMPTS[:2], [stuck, fine])
        assert bad.samples[0].finish_reason == "error" and bad.samples[0].error_class == "grammar_error"
        assert "allows no next token after 0 tokens" in bad.samples[0].error and "stop_token_ids" in \
            bad.samples[0].error
        assert good.samples[0].finish_reason == "stop" and good.samples[0].text == "yes"

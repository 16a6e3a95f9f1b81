"""The Python API's entry points: chat() through the chat template, generate(), and the settings models."""

from __future__ import annotations

import pydantic
import pytest

from batchgen import Engine, EngineConfig, SamplingParams
from conftest import make_model


def test_chat_renders_the_chat_template_and_equals_generate_on_the_templated_ids(tokenizer):
    model = make_model("llama", vocab_size=len(tokenizer))
    conversations = [[{"role": "user", "content": "Write a short poem about the sea."}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    with Engine(model, tokenizer, EngineConfig(num_kv_blocks=64, block_size=8)) as engine:
        chatted = engine.chat(conversations, params)
        ids = [tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False) for c in conversations]
        direct = engine.generate(ids, params)
    assert [r.prompt_token_ids for r in chatted] == ids
    assert ids[0][:1] == tokenizer.encode("<|im_start|>", add_special_tokens=False)  # the template's own start
    assert [r.samples[0].token_ids for r in chatted] == [r.samples[0].token_ids for r in direct]
    assert all(len(r.samples[0].token_ids) == 8 for r in chatted)


def test_chat_refuses_a_tokenizer_without_a_chat_template_and_malformed_conversations(tokenizer):
    model = make_model("llama", vocab_size=len(tokenizer))
    with Engine(model, None, EngineConfig(num_kv_blocks=16)) as engine:
        with pytest.raises(ValueError, match="chat template"):
            engine.chat([[{"role": "user", "content": "hi"}]])
    with Engine(model, tokenizer, EngineConfig(num_kv_blocks=16)) as engine:
        with pytest.raises(ValueError, match="conversation 0 must be a list of"):
            engine.chat(["just a string"])
        with pytest.raises(ValueError, match="chat_template_kwargs: 'tokenize' cannot be set here"):
            engine.chat([[{"role": "user", "content": "hi"}]], chat_template_kwargs={"tokenize": True})


def test_a_stop_string_given_as_one_string_is_one_stop_string():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["END", "STOP"]).stop == ("END", "STOP")


def test_invalid_sampling_and_engine_values_raise_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        SamplingParams(stop=[""])
    with pytest.raises(pydantic.ValidationError, match="unknown_knob"):
        EngineConfig(unknown_knob=1)


def test_the_job_file_and_the_api_share_one_definition_of_each_setting():
    from batchgen.config import JobSpec

    sampling = JobSpec.model_fields["sampling"].annotation  # SamplingParams + the job-only column name
    assert issubclass(sampling, SamplingParams)
    assert set(sampling.model_fields) - set(SamplingParams.model_fields) == {"response_format_column"}
    assert all(repr(sampling.model_fields[k]) == repr(f) for k, f in SamplingParams.model_fields.items())
    assert JobSpec.model_fields["engine"].annotation is EngineConfig
    assert EngineConfig.model_validate({"async": False}).async_pipeline is False  # the YAML name
    assert EngineConfig(async_pipeline=True).async_on("cpu") and not EngineConfig().async_on("cpu")


def test_a_job_file_stop_given_as_one_string_is_one_stop_string(tmp_path, tiny_model_dir):
    from batchgen.job.job_file import load_spec
    from jobutil import write_job

    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl"}, sampling={"stop": "END"})
    assert load_spec(job).sampling.stop == ("END",)
    assert load_spec(job, ["sampling.stop=END"]).sampling.stop == ("END",)


def test_stats_count_decode_and_mixed_steps_and_every_prefill_token():
    """Engine.stats() splits the steps by kind (runner/step_timing.py): a step with any prompt tokens is mixed,
    the rest decode; every prompt token not served from the prefix cache is counted once."""
    model = make_model("llama")
    prompts = [[5 + i] * n for i, n in enumerate((3, 40, 17, 9))]  # distinct tokens: no prefix-cache hits
    with Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=2,
                                          max_num_batched_tokens=16)) as engine:
        engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
        stats = engine.stats()
    assert stats["num_prefill_tokens"] == sum(map(len, prompts))
    assert stats["num_decode_steps"] + stats["num_mixed_steps"] == stats["num_steps"]
    # 69 prompt tokens in chunks of at most 16 a step: at least 5 mixed steps; two sequences at a time, 6 tokens
    # each, the first sampled in its last prefill step: decode steps remain
    assert stats["num_mixed_steps"] >= 5 and stats["num_decode_steps"] >= 5
    assert stats["gpu_busy_s"] == 0.0 and stats["gpu_idle_s_before_mixed"] == 0.0  # CPU: no device timing


def test_a_wave_of_rows_finishing_together_is_handed_out_over_several_steps_and_none_is_lost():
    """40 equal rows finish in one step while 40 more wait: their results (detokenized text) come back at most
    max(MIN_RESULTS_PER_STEP, an eighth of the backlog) a step, so the host's work on them is spread out; when
    the engine runs dry every remaining result comes at once."""
    from batchgen.engine.engine import MIN_RESULTS_PER_STEP

    model = make_model("llama")
    prompts = [[5 + i % 50] * 6 for i in range(80)]
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    with Engine(model, None, EngineConfig(num_kv_blocks=256, block_size=8, max_num_seqs=40,
                                          async_pipeline=False)) as engine:
        expected = {tuple(p): r.samples[0].token_ids for p, r in zip(prompts, engine.generate(prompts, params))}
        ids = {engine.add_request(p, params): p for p in prompts}
        per_step, got = [], {}
        while engine.has_unfinished:
            results = engine.step()
            per_step.append(len(results))
            got.update({r.request_id: r.samples[0].token_ids for r in results})
    assert sorted(got) == sorted(ids) and all(got[i] == expected[tuple(p)] for i, p in ids.items())
    first_wave = per_step.index(next(n for n in per_step if n))  # the step where the first 40 finished
    assert per_step[first_wave] == MIN_RESULTS_PER_STEP and max(per_step[:-1]) <= MIN_RESULTS_PER_STEP


def test_the_job_loop_refills_a_finished_wave_a_few_rows_a_pass_but_never_lets_the_engine_run_short():
    from types import SimpleNamespace

    from batchgen.job.loop import JobLoop

    def wants(queued, num_admitted, engine=True):
        loop = SimpleNamespace(engine=SimpleNamespace(num_unfinished_prompts=queued) if engine else None,
                               spec=SimpleNamespace(engine=SimpleNamespace(max_num_seqs=256)))
        return JobLoop._wants_rows(loop, num_admitted, lookahead=512, refill=16)

    assert wants(0, 0, engine=False) and wants(0, 300)  # no engine yet / fewer prompts than a step takes
    assert wants(255, 100) and not wants(256, 16) and wants(256, 15)  # a step's worth queued: a few a pass
    assert not wants(512, 0)  # the lookahead is full

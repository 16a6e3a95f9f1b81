"""FP8 mixture-of-experts: the grouped expert GEMMs over FP8 experts (block scales, activations quantised per token
and group: W8A8) against the torch reference under TRITON_INTERPRET=1 and on the GPU, and FP8 MoE checkpoints
(Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral's block_sparse_moe names) loaded with their experts kept in
FP8, generating on CPU the tokens transformers generates over the same checkpoint dequantised."""

from __future__ import annotations

import pytest
import torch
from conftest import (hf_greedy, hf_token_logprobs, make_model, make_tokenizer, random_prompts,
                      run_under_interpreter)
from fp8_checkpoints import exact_activations, save_fp8_checkpoint

from batchgen.engine.config import EngineConfig
from batchgen.engine.engine import Engine
from batchgen.errors import JobError
from batchgen.kernels.fp8.quant import FP8_DTYPE, Fp8Weight, quantize_weight
from batchgen.runner.loader import load_model
from batchgen.sampling_params import SamplingParams


def _fp8_experts(w: torch.Tensor, group: int) -> Fp8Weight:
    """[E, N, K] float weights quantised per expert in group x group blocks."""
    parts = [quantize_weight(w[e], group, group) for e in range(w.shape[0])]
    return Fp8Weight(torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]), group, group, True)


def _case(device, dtype, num_tokens, hidden, inter, num_experts, top_k, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # exact_activations draws from the global generator
    h = exact_activations(num_tokens, hidden, group).to(device, dtype)
    gate_up = _fp8_experts(torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5, group)
    down = _fp8_experts(torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5, group)
    gate_up, down = (Fp8Weight(w.weight.to(device), w.scale.to(device), group, group, True) for w in (gate_up, down))
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, 1] = -1e9  # an expert no pair routes to
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return h, gate_up, down, ids.to(device), weights.to(device, dtype)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def check_fp8_moe(device, dtype, tol, **shape):
    """Each grouped GEMM alone over exactly quantisable rows, equal to the W8A8 reference to fp32 rounding: gate_up
    (rows gathered by pair), down (times the routing weight); then the whole experts' output, within `tol` (its
    down GEMM quantises the gated activations: the interpreter's fp32 -> fp8 rounding differs from torch's by an
    fp8 step where it carries into the exponent, which moves a 32-term product by a few %)."""
    from batchgen.kernels.moe.experts import choose_block_m, fused_experts, fused_experts_ref, grouped_gemm
    from batchgen.kernels.fp8.quant import linear_ref
    from batchgen.kernels.moe.routing import align_pairs

    h, gate_up, down, ids, weights = _case(device, dtype, **shape)
    top_k, num_experts = ids.shape[1], gate_up.shape[0]
    align = align_pairs(ids, num_experts, choose_block_m(ids.numel(), num_experts))
    got = grouped_gemm(h, gate_up, align, a_row_div=top_k)  # [S, 2 I]
    flat = ids.reshape(-1)
    want = torch.stack([linear_ref(h[p // top_k][None], gate_up.weight[e], gate_up.scale[e], gate_up.group_n,
                                   gate_up.group_k, act_group=gate_up.group_k)[0] for p, e in enumerate(flat.tolist())])
    exact_tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and _rel_err(got, want) < exact_tol
    act = exact_activations(ids.numel(), down.weight.shape[2], down.group_k).to(device, dtype)  # [S, I]
    rw = weights.reshape(-1)
    got = grouped_gemm(act, down, align, a_row_div=1, routing_weights=rw)  # [S, H]
    want = torch.stack([linear_ref(act[p][None], down.weight[e], down.scale[e], down.group_n, down.group_k,
                                   act_group=down.group_k)[0].float() * rw[p].float()
                        for p, e in enumerate(flat.tolist())])
    assert _rel_err(got, want) < exact_tol
    out = fused_experts(h, gate_up, down, ids, weights, use_triton=True)
    ref = fused_experts_ref(h, gate_up, down, ids, weights, w8a8=True)
    assert out.dtype == dtype and not out.isnan().any() and _rel_err(out, ref) < tol, _rel_err(out, ref)
    # the dequantised reference (the CPU path) differs from W8A8 by the activations' quantisation only
    assert _rel_err(fused_experts_ref(h, gate_up, down, ids, weights), ref) < 0.1


INTERPRET_SCRIPT = """
import sys, torch
sys.path[:0] = ["tests", "tests/quant"]
from test_fp8_moe import check_fp8_moe
check_fp8_moe("cpu", torch.float32, 0.1, num_tokens=7, hidden=64, inter=32, num_experts=4, top_k=2, group=32)
check_fp8_moe("cpu", torch.float32, 0.1, num_tokens=40, hidden=64, inter=64, num_experts=3, top_k=2, group=32)
print("ok")
"""


def test_fp8_grouped_expert_gemms_equal_the_w8a8_reference_under_triton_interpreter():
    run_under_interpreter(INTERPRET_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 32, 256])
def test_fp8_grouped_expert_gemms_bf16_on_gpu_at_qwen3_30b_a3b_sizes(num_tokens):
    check_fp8_moe("cuda", torch.bfloat16, 3e-2, num_tokens=num_tokens, hidden=2048, inter=768, num_experts=128,
                  top_k=8, group=128)


# ---- checkpoints ----------------------------------------------------------------------------------------------

NEW_TOKENS = 12


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_fp8_moe_checkpoint_keeps_its_experts_fp8_and_generates_transformers_dequantized_tokens(tmp_path, arch):
    """A block-wise FP8 checkpoint (transformers' FineGrainedFP8 quantiser, per-expert tensors as save_pretrained
    writes them; Mixtral's under block_sparse_moe with w1/w3/w2) loads with the experts one byte a weight and runs
    the fused MoE decoder, greedy tokens and log-probs equal to transformers' own FP8 loader's (which dequantises
    on a machine without a GPU)."""
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer()
    model = make_model(arch, vocab_size=len(tok))
    folder = save_fp8_checkpoint(model, tok, tmp_path / arch, "block")
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    experts = ref.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32  # dequantised by transformers
    assert not torch.equal(experts.gate_up_proj, model.model.layers[0].mlp.experts.gate_up_proj)  # quantisation moved it
    prompts = random_prompts([5, 9, 13], vocab_size=len(tok), seed=3)
    want = [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]
    want_logp = [hf_token_logprobs(ref, p, t) for p, t in zip(prompts, want)]
    # the test can fail: quantisation moves the log-probs far past the tolerance below
    assert max((hf_token_logprobs(model, p, t) - lp).abs().max() for p, t, lp in zip(prompts, want, want_logp)) > 1e-3
    fp8 = load_model(str(folder), "float32", "cpu")
    loaded = fp8.model.layers[0].mlp.experts
    assert loaded.gate_up_proj.dtype == FP8_DTYPE and loaded.down_proj.dtype == FP8_DTYPE
    assert loaded.gate_up_proj.shape == experts.gate_up_proj.shape
    for async_pipeline in (False, True):
        engine = Engine(fp8, tok, EngineConfig(async_pipeline=async_pipeline, max_num_batched_tokens=16))
        assert engine.decode_path == "fused"
        results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                          ignore_eos=True, logprobs=0))
        assert [r.samples[0].token_ids for r in results] == want, (arch, async_pipeline)
        for r, lp in zip(results, want_logp):
            torch.testing.assert_close(torch.tensor(r.samples[0].logprobs), lp, atol=1e-4, rtol=0)
        engine.close()


@pytest.mark.parametrize("fmt,words", [
    ("channel", "FP8 mixture-of-experts checkpoints are built for block-wise scales"),
])
def test_fp8_moe_checkpoints_other_than_block_scaled_are_refused_naming_model_path(tmp_path, fmt, words):
    tok = make_tokenizer()
    folder = save_fp8_checkpoint(make_model("qwen3_moe", vocab_size=len(tok)), tok, tmp_path / "moe", fmt)
    with pytest.raises(JobError, match="model.path") as e:
        load_model(str(folder), "float32", "cpu")
    assert words in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fp8_moe_engine_with_cuda_graphs_and_async_equals_eager_sync_bf16_on_gpu(tmp_path, arch):
    """The FP8 experts' grouped GEMMs (and their activation quantisers) replay from the decode CUDA graphs: greedy
    tokens equal to eager sync steps on the same loaded checkpoint (32 x 32 blocks, max_num_seqs 8)."""
    tok = make_tokenizer()
    folder = save_fp8_checkpoint(make_model(arch, vocab_size=len(tok)), tok, tmp_path / arch, "block")
    model = load_model(str(folder), "bfloat16", "cuda")
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == FP8_DTYPE
    prompts = random_prompts([5, 9, 13, 17, 40], vocab_size=len(tok), seed=3)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = []
    for graphs, async_pipeline in ((False, False), (True, True)):
        engine = Engine(model, tok, EngineConfig(cuda_graphs=graphs, async_pipeline=async_pipeline, max_num_seqs=8))
        assert engine.decode_path == "fused"
        outs.append([r.samples[0].token_ids for r in engine.generate(prompts, params)])
        engine.close()
    assert outs[0] == outs[1]


def test_an_fp8_moe_checkpoint_with_one_expert_in_another_format_or_missing_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    tok = make_tokenizer()
    folder = save_fp8_checkpoint(make_model("qwen3_moe", vocab_size=len(tok)), tok, tmp_path / "moe", "block")
    path = folder / "model.safetensors"
    state = load_file(str(path))
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    state[key] = state[key].float()  # one expert's up projection left in fp32
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(JobError, match=f"{key} is torch.float32; the layer's other experts are FP8"):
        load_model(str(folder), "float32", "cpu")
    del state[key], state[key + "_scale_inv"]
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(JobError, match="the checkpoint lacks expert 3's up weight of model.layers.1.mlp.experts"):
        load_model(str(folder), "float32", "cpu")

"""The MoE families' fused forwards (MOE_ARCHS) on CPU beyond greedy equality (test_fused_decoder.py): expert
weights read in place, the routers' roundings bit for bit in bf16, dense layers from the config, the reasons a
model falls back, the routing counts the bench reads, and the Triton wiring under the interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.attention.kv_cache import KVCache, KVGeometry
from batchgen.models.blocks import GatedMLP
from batchgen.models.moe import SparseMoE
from batchgen.models.registry import DECODERS, unsupported_reason
from conftest import MOE_ARCHS, hf_greedy, make_model, one_sequence_meta, random_prompts


def _decoder(model, dtype=torch.float32):
    cache = KVCache(KVGeometry.from_config(model.config), 8, 16, dtype, torch.device("cpu"))
    return DECODERS[model.config.model_type](model, cache, use_triton=False), cache


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_decoder_reads_the_experts_3d_parameters_in_place_and_transformers_forward_is_unchanged(arch):
    model = make_model(arch)
    ids = torch.tensor([random_prompts((9,))[0]])
    before = model(ids).logits
    decoder, _ = _decoder(model)
    sparse, fused = model.model.layers[0].mlp, decoder.layers[0].mlp
    assert isinstance(fused, SparseMoE)
    assert fused.gate_up.data_ptr() == sparse.experts.gate_up_proj.data_ptr()  # [E, 2 I, H], no copy
    assert fused.down.data_ptr() == sparse.experts.down_proj.data_ptr()
    assert fused.router_weight.data_ptr() == sparse.gate.weight.data_ptr()
    if arch == "qwen2_moe":  # the shared expert's gate/up rebound into one tensor, once
        assert fused.shared.gate_up_weight.data_ptr() == sparse.shared_expert.gate_proj.weight.data_ptr()
    torch.testing.assert_close(model(ids).logits, before, atol=0, rtol=0)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_sparse_block_equals_transformers_sparse_block_bit_for_bit_in_bf16(arch):
    """The routers' roundings: Qwen's weights rounded to bf16 before the product, Mixtral's kept fp32; the sum
    over k in fp32, rounded once (transformers' default grouped_mm experts forward)."""
    model = make_model(arch).to(torch.bfloat16)
    decoder, _ = _decoder(model, torch.bfloat16)
    h = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        ours = decoder.layers[0].mlp(h, False)
        theirs = model.model.layers[0].mlp(h[None])[0]
        _, weights = decoder.layers[0].mlp.route(h)
    assert weights.dtype == (torch.float32 if arch == "mixtral" else torch.bfloat16)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("arch,dense", [("qwen3_moe", dict(mlp_only_layers=[1])),
                                        ("qwen2_moe", dict(decoder_sparse_step=2))])
def test_dense_layers_of_the_config_run_the_dense_mlp_and_logits_equal_transformers(arch, dense):
    model = make_model(arch, num_layers=3, **dense)
    decoder, cache = _decoder(model)
    kinds = [type(layer.mlp) for layer in decoder.layers]
    assert kinds == ([SparseMoE, GatedMLP, SparseMoE] if arch == "qwen3_moe" else [GatedMLP, SparseMoE, GatedMLP])
    ids = random_prompts((21,))[0]
    n = len(ids)
    meta = one_sequence_meta(cache, n)
    got = decoder.forward_packed(torch.tensor(ids), torch.arange(n), meta, torch.arange(n))
    torch.testing.assert_close(got, model(torch.tensor([ids])).logits[0], atol=1e-5, rtol=1e-5)
    prompts = random_prompts((6, 19))
    expected = [hf_greedy(model, p, 8) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=32, block_size=16))
    assert engine.decode_path == "fused"
    got = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    assert [r.samples[0].token_ids for r in got] == expected


def test_moe_models_fall_back_only_where_the_fused_layers_cannot_run_them_and_say_why():
    windowed = make_model("mixtral", sliding_window=8)  # a window is served by the kernels, as Mistral's
    assert unsupported_reason(windowed, 1024) is None
    prompts = random_prompts((5, 30, 17))
    expected = [hf_greedy(windowed, p, 10) for p in prompts]
    got = Engine(windowed, None, EngineConfig(num_kv_blocks=32, block_size=16)).generate(
        prompts, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    assert [r.samples[0].token_ids for r in got] == expected
    assert unsupported_reason(make_model("qwen3_moe", hidden_act="gelu"), 1024) == "activation 'gelu'"
    legacy = make_model("mixtral")
    legacy.model.layers[1].mlp.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])  # the pre-5.x layout
    assert unsupported_reason(legacy, 1024).startswith("experts not stored as 3-D gate_up_proj / down_proj")
    engine = Engine(legacy, None, EngineConfig(num_kv_blocks=8))
    assert engine.decode_path == "transformers" and "experts not stored" in engine.runner.decode_forward.name


def test_routing_counts_add_every_tokens_top_k_choices_of_every_sparse_layer():
    model = make_model("qwen3_moe", num_layers=3, mlp_only_layers=[1])
    engine = Engine(model, None, EngineConfig(num_kv_blocks=32, block_size=16))
    counts = engine.runner.decode_forward.count_routes()  # [L, E]
    prompts = random_prompts((5, 12))
    engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    tokens = sum(len(p) for p in prompts) + 2 * 3  # the last sampled token of each is never fed back
    assert counts.sum(dim=1).tolist() == [tokens * 2, 0, tokens * 2]
    assert (counts[0] > 0).sum() > 2  # spread over the experts, not one


def test_moe_fused_steps_with_triton_kernels_match_the_reference_path_under_triton_interpreter():
    """The MoE decoders' wiring of the grouped-GEMM kernels inside a decode step and a packed (mixed) step."""
    pytest.importorskip("triton")
    from test_fused_decoder import run_fused_steps_under_interpreter

    run_fused_steps_under_interpreter(list(MOE_ARCHS))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_decoder_step_kernels_equal_the_torch_glue_bit_for_bit_on_gpu(arch, monkeypatch):
    """The whole decoder in bf16 with 128 experts, top-8 (Qwen3-30B-A3B's routing shape), over 1, 32 and 256
    tokens: the alignment and combine kernels run (the combine's check against torch's sum passes for the
    family's weights dtype) and give the logits of the torch ops around the same grouped GEMMs, bit for bit
    (then the alignment is forced to the torch ops and the combine to torch's sum)."""
    from batchgen.kernels.moe import routing as R

    model = make_model(arch, num_layers=2, num_experts=128, num_local_experts=128, num_experts_per_tok=8,
                       hidden_size=256, intermediate_size=256, moe_intermediate_size=256).to("cuda", torch.bfloat16)
    cache = KVCache(KVGeometry.from_config(model.config), 32, 16, torch.bfloat16, torch.device("cuda"))
    decoder = DECODERS[model.config.model_type](model, cache, use_triton=True)
    weighted = torch.float32 if arch == "mixtral" else torch.bfloat16  # Mixtral's routing weights stay fp32
    key = (str(next(model.parameters()).device), 8, weighted, torch.bfloat16)
    sparse = sum(isinstance(layer.mlp, SparseMoE) for layer in decoder.layers)
    assert sparse
    assert R._ACCUMULATORS.get(key), R._ACCUMULATORS  # checked when the decoder was built, and exact
    calls = {"align": 0, "combine": 0}
    for name, kind in (("align_by_expert_triton", "align"), ("combine_topk", "combine")):
        def spy(*a, _f=getattr(R, name), _kind=kind, **kw):
            calls[_kind] += 1
            return _f(*a, **kw)
        monkeypatch.setattr(R, name, spy)
    for n in (1, 32, 256):
        ids = torch.tensor(random_prompts((n,))[0], device="cuda")
        meta = one_sequence_meta(cache, n)
        meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).cuda() for f in dataclasses.fields(meta)
                                            if isinstance(getattr(meta, f.name), torch.Tensor)})
        args = (ids, torch.arange(n, device="cuda"), meta, torch.arange(n, device="cuda"))
        with torch.inference_mode():
            calls.update(align=0, combine=0)
            fused = decoder.forward_packed(*args)
            assert calls == {"align": sparse, "combine": sparse}, (n, calls)  # one each per sparse layer
            with monkeypatch.context() as m:
                m.setattr(R, "ALIGN_MAX_PAIRS", 0)
                m.setitem(R._ACCUMULATORS, key, 0)
                glue = decoder.forward_packed(*args)
            assert calls == {"align": sparse, "combine": sparse}, (n, calls)  # the glue: torch ops only
        assert torch.equal(fused, glue), n

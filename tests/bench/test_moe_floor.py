"""The MoE bandwidth floor's inputs on CPU: the weight bytes every step reads plus the distinct experts' bytes
add up to the model's own parameters, and the route recorder counts each step's distinct experts."""

from __future__ import annotations

import pytest
import torch

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.bench.moe_floor import RouteRecorder, dense_step_bytes, expert_bytes, routed_step_bytes, sparse_layers
from conftest import MOE_ARCHS, make_model, random_prompts


def _bytes_but_embedding(model, dtype_bytes):
    return sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) * dtype_bytes


@pytest.mark.parametrize("arch,extra", [(a, {}) for a in MOE_ARCHS] + [("qwen2_moe", dict(decoder_sparse_step=2)),
                                                                       ("qwen3_moe", dict(mlp_only_layers=[0]))])
def test_dense_bytes_plus_every_expert_are_the_models_parameters_less_the_embedding(arch, extra):
    model = make_model(arch, num_layers=3, **extra)
    cfg = model.config
    num_experts = cfg.num_local_experts if arch == "mixtral" else cfg.num_experts
    every = dense_step_bytes(cfg, 4) + sum(sparse_layers(cfg)) * num_experts * expert_bytes(cfg, 4)
    assert every == _bytes_but_embedding(model, 4)
    assert routed_step_bytes([0, 2], cfg, 4) == [dense_step_bytes(cfg, 4), dense_step_bytes(cfg, 4)
                                                 + 2 * expert_bytes(cfg, 4)]


def test_qwen3_30b_a3b_geometry_has_its_30_5b_parameters_and_3_3b_active():
    import transformers

    from batchgen.bench.geometries import GEOMETRIES

    cfg = transformers.Qwen3MoeConfig(**GEOMETRIES["qwen3-30b-a3b"][1])
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    assert dense_step_bytes(cfg, 1) + 48 * 128 * expert_bytes(cfg, 1) == _bytes_but_embedding(model, 1)
    assert 30.4e9 < sum(p.numel() for p in model.parameters()) < 30.6e9
    active = dense_step_bytes(cfg, 1) + 48 * 8 * expert_bytes(cfg, 1) + cfg.vocab_size * cfg.hidden_size
    assert 3.2e9 < active < 3.4e9


def test_route_recorder_counts_each_steps_distinct_experts_over_the_sparse_layers():
    model = make_model("qwen3_moe", num_layers=3, mlp_only_layers=[1])
    engine = Engine(model, None, EngineConfig(num_kv_blocks=32, block_size=16))
    recorder = RouteRecorder(engine)
    with recorder.watch():
        engine.generate(random_prompts((9,)), SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    distinct = recorder.distinct_per_step()
    assert len(distinct) == 5  # one prefill step, four decode steps
    assert 2 * 2 < distinct[0] <= 2 * 8  # 9 tokens over two sparse layers of 8 experts
    assert distinct[1:] == [2 * 2] * 4  # one token: its top-2 in each sparse layer

"""`batchgen bench --tensor-parallel N`: each rank builds its own shard of a random model (never the whole model)
that an Engine runs across the ranks; the floor splits the weights, the LM head and the K/V over the GPUs and adds
the collectives of every step; options the tensor-parallel bench cannot run are refused up front, naming it."""

from __future__ import annotations

import pytest
import torch

from batchgen.bench.geometries import model_config
from batchgen.bench.seed import Ceilings, floor_seconds
from batchgen.bench.tp_floor import CollectiveLatency, tensor_parallel_floor
from conftest import random_prompts

# 129 vocabulary rows: rank 1's LM-head shard is padded to 65
TINY = dict(vocab_size=129, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
PROMPTS = random_prompts((7, 12), vocab_size=129, seed=3)
NEW_TOKENS = 5
KEPT = ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight", "lm_head.weight")


def _build_and_decode(tp) -> dict:
    """On each rank: its random shard (twice), a real model sharded by shard_model_, and an Engine over the shard
    (rank 0 generates, the other rank follows)."""
    from itertools import chain

    from transformers import AutoModelForCausalLM

    from batchgen import Engine, SamplingParams
    from batchgen.bench.seed import seed_engine_config
    from batchgen.bench.tp_seed import follow_engine
    from batchgen.bench.tp_shard import build_random_shard
    from batchgen.models.shard import shard_model_

    config = model_config("llama-70b", **TINY)
    shard = build_random_shard(config, tp.rank, tp.size, tp.device, dtype=torch.float32)
    again = build_random_shard(config, tp.rank, tp.size, tp.device, dtype=torch.float32)
    real = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shard_model_(real, tp.rank, tp.size)
    out = {"shapes": {n: tuple(p.shape) for n, p in shard.named_parameters()},
           "real_shapes": {n: tuple(p.shape) for n, p in real.named_parameters()},
           "on_meta": [n for n, t in chain(shard.named_parameters(), shard.named_buffers()) if t.is_meta],
           "repeats": all(torch.equal(a, b) for a, b in zip(shard.parameters(), again.parameters(), strict=True)),
           "kept": {n: p.detach().numpy().copy() for n, p in shard.named_parameters() if n in KEPT}}
    engine_config = seed_engine_config(4, "eager", tp.size)
    if not tp.is_leader:
        out["num_steps"] = follow_engine(shard, engine_config, tp).num_steps
        return out
    engine = Engine(shard, None, engine_config, tensor_parallel=tp)
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    out["tokens"] = [r.samples[0].token_ids for r in results]
    out["num_steps"] = engine.num_steps
    engine.close()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    from batchgen.distributed.spawn import run_group

    return run_group(_build_and_decode, 2, timeout_s=240)


def test_each_rank_s_random_shard_has_the_shapes_shard_model_gives_a_real_model_and_nothing_on_meta(two_ranks):
    for rank in two_ranks:
        assert rank["shapes"] == rank["real_shapes"]
        assert rank["on_meta"] == []
    assert two_ranks[1]["shapes"]["lm_head.weight"] == (65, 64)  # ceil(129 / 2) rows, padded
    assert two_ranks[0]["shapes"]["model.layers.0.self_attn.q_proj.weight"] == (32, 64)  # 2 of 4 heads


def test_whole_parameters_match_on_every_rank_while_shards_differ_and_every_build_repeats(two_ranks):
    leader, follower = two_ranks[0]["kept"], two_ranks[1]["kept"]
    assert (leader["model.embed_tokens.weight"] == follower["model.embed_tokens.weight"]).all()
    assert (leader["model.norm.weight"] == 1.0).all() and (follower["model.norm.weight"] == 1.0).all()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
        assert not (leader[name] == follower[name]).all(), name
    assert 0.015 < leader["model.layers.1.mlp.down_proj.weight"].std() < 0.025  # normal(0, 0.02)
    assert all(rank["repeats"] for rank in two_ranks)


def test_an_engine_decodes_greedily_through_the_shards_with_the_follower_serving_every_step(two_ranks):
    leader, follower = two_ranks
    assert [len(t) for t in leader["tokens"]] == [NEW_TOKENS] * len(PROMPTS)
    assert all(0 <= i < TINY["vocab_size"] for t in leader["tokens"] for i in t)
    assert "tokens" not in follower and follower["num_steps"] == leader["num_steps"] >= NEW_TOKENS


def test_the_tensor_parallel_floor_splits_weights_lm_head_and_kv_and_adds_the_collectives_of_every_step():
    """By hand for TINY at N = 2 (head_dim 16), 3 requests of 10 prompt tokens, 4 new tokens."""
    config = model_config("llama-70b", **TINY)
    floor = tensor_parallel_floor(config, requests=3, prompt=10, new=4, size=2, ceilings=Ceilings(1e6, 1e9),
                                  latency=CollectiveLatency(all_reduce_s=1e-3, all_gather_s=5e-3))
    projections = 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 128)  # 2 layers: q, k, v, o; gate, up, down
    head_rows = 65  # ceil(129 / 2)
    assert floor.weight_bytes_per_gpu == 2 * projections // 2 + head_rows * 64 * 2 == 82048
    kv_per_token_layer = 2 * 1 * 16 * 2  # K and V, 2 KV heads / 2 ranks, head_dim 16, bf16
    assert floor.kv_bytes_per_gpu == 3 * kv_per_token_layer * 2 * (10 + 11 + 12 + 13) == 17664
    assert floor.prefill_flops_per_gpu == 2 * projections * 3 * 10 / 2  # prompt tokens skip the LM head
    assert (floor.all_reduces_per_step, floor.all_gathers_per_step, floor.num_steps) == (4, 1, 4)
    assert floor.weights_s == pytest.approx(4 * 82048 / 1e6)
    assert floor.kv_s == pytest.approx(17664 / 1e6)
    assert floor.collectives_s == pytest.approx(4 * (4 * 1e-3 + 5e-3))
    assert floor.seconds == pytest.approx(0.328192 + 0.017664 + 0.00221184 + 0.036)
    assert floor.parts()["floor_s"] == floor.seconds


@pytest.mark.parametrize("geometry", ["llama-8b", "gemma2-9b"])
def test_the_tensor_parallel_floor_of_one_gpu_without_collectives_is_the_seed_floor(geometry):
    config, ceilings = model_config(geometry), Ceilings(4.25e12, 793e12)
    one = tensor_parallel_floor(config, 32, 256, 1024, 1, ceilings, CollectiveLatency(1.0, 1.0))
    assert one.collectives_s == 0
    assert one.seconds == pytest.approx(floor_seconds(config, 32, 256, 1024, ceilings))


def test_the_70b_floor_on_two_gpus_reads_half_the_weights_and_waits_for_160_all_reduces_a_step():
    config, ceilings = model_config("llama-70b"), Ceilings(4.25e12, 793e12)
    two = tensor_parallel_floor(config, 32, 256, 1024, 2, ceilings, CollectiveLatency(10e-6, 20e-6))
    whole = floor_seconds(config, 32, 256, 1024, ceilings)
    assert two.all_reduces_per_step == 160
    assert two.collectives_s == pytest.approx(1024 * (160 * 10e-6 + 20e-6))
    assert two.seconds - two.collectives_s == pytest.approx(whole / 2, rel=1e-6)


def _bench(size: int, *args: str):
    from typer.testing import CliRunner

    from batchgen.cli import app

    return CliRunner().invoke(app, ["bench", "--tensor-parallel", str(size), *args])


@pytest.mark.parametrize("args,message", [
    (["--workload", "job"], "--tensor-parallel 2 runs the seed workload only, not --workload job"),
    (["--workload", "mixed"], "--tensor-parallel 2 runs the seed workload only, not --workload mixed"),
    (["--model-geometry", "mixtral-8x7b"], "--tensor-parallel 2 with --model-geometry mixtral-8x7b: the "
                                           "tensor-parallel bench's floor counts dense weights"),
    (["--model-geometry", "qwen3-30b-a3b"], "mixture-of-experts geometries (their routed-bytes floor) run on one GPU"),
    (["--weights", "fp8"], "--tensor-parallel 2 runs bf16 weights only, not --weights fp8"),
    (["--variants", "graphs_async,compiled"], "--tensor-parallel 2 with variant 'compiled'"),
    (["--transformers", "sync"], "leave out --transformers"),
])
def test_bench_refuses_what_tensor_parallelism_cannot_run_naming_the_option_before_any_gpu(args, message):
    result = _bench(2, "--model-geometry", "llama-70b", *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_bench_refuses_a_size_that_does_not_divide_the_heads_or_is_below_two():
    result = _bench(3, "--model-geometry", "llama-70b")
    assert result.exit_code == 2 and "--tensor-parallel 3 with --model-geometry llama-70b" in result.output
    assert "num_attention_heads (64)" in result.output
    result = _bench(1)
    assert result.exit_code == 2 and "--tensor-parallel 1: give 2 or more GPUs" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the options get as far as the GPU check")
def test_bench_takes_the_70b_two_gpu_command_up_to_its_gpu_check():
    result = _bench(2, "--model-geometry", "llama-70b", "--new-tokens", "1024", "--variants", "graphs_async")
    assert result.exit_code == 2 and "`batchgen bench` needs a CUDA GPU" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_the_two_gpu_seed_bench_times_its_collectives_and_runs_above_its_floor(tmp_path):
    import json

    from batchgen.bench.tp_seed import main

    report = main(2, new_tokens=16, requests=4, prompt_len=32, json_path=str(tmp_path / "tp.json"), max_num_seqs=4,
                  variants="graphs_async", geometry="llama-8b")
    assert 0 < report["all_reduce_us"] < 1000 and 0 < report["all_gather_us"] < 1000
    run = report["ours_tp2_graphs_async"]
    assert run["tokens"] == 4 * 16 and run["x_floor"] > 1 and run["kernels_per_decode_step"] > 0
    assert json.loads((tmp_path / "tp.json").read_text())["floor_parts"]["all_reduces_per_step"] == 64

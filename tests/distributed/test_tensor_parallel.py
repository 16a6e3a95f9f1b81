"""Tensor parallelism on CPU (gloo, 2 processes): the sharded engine's greedy fp32 output is token-identical to the
unsharded engine's, through chunked prefill, decode steps and preemption, sync and async; every rank samples the
same tokens (also with temperature and penalties); mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared
expert and a dense layer, Mixtral) split every expert; OLMo2's q/k norms span the ranks; models that cannot be split
are refused up front."""

from __future__ import annotations

import hashlib

import pytest

from batchgen import Engine, EngineConfig, SamplingParams
from conftest import make_model, random_prompts

PROMPTS = random_prompts((5, 17, 33, 8, 40, 1), vocab_size=500, seed=5)  # ids < every vocabulary below
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.2,
                         presence_penalty=0.3, ignore_eos=True)
# (arch, make_model overrides, engine config, sampling): a small token budget chunks the 33- and 40-token prompts
# over several steps and mixes them with decodes; 13 blocks of 4 force preemptions
SCENARIOS = [
    ("llama", {}, dict(max_num_batched_tokens=16, async_pipeline=False), GREEDY),
    ("llama", {}, dict(max_num_batched_tokens=16, async_pipeline=True, num_kv_blocks=13, block_size=4), GREEDY),
    ("qwen3", {}, dict(max_num_batched_tokens=16, async_pipeline=True), GREEDY),
    ("qwen2", {}, dict(max_num_batched_tokens=24, async_pipeline=False), GREEDY),
    ("qwen2", {"vocab_size": 509}, dict(async_pipeline=True), GREEDY),  # 509 rows: the last rank's are padded
    ("phi3", {}, dict(max_num_batched_tokens=16, async_pipeline=True), GREEDY),
    ("gemma2", {}, dict(max_num_batched_tokens=16, async_pipeline=False), GREEDY),
    ("starcoder2", {}, dict(max_num_batched_tokens=16, async_pipeline=True), GREEDY),
    ("olmo2", {}, dict(max_num_batched_tokens=16, async_pipeline=True), GREEDY),  # q/k norms over all heads
    ("granite", {}, dict(async_pipeline=True), SAMPLED),
    # mixture-of-experts: every expert split along its intermediate dimension, the router whole on each rank
    ("qwen3_moe", {}, dict(max_num_batched_tokens=16, async_pipeline=True), GREEDY),
    ("qwen2_moe", {"mlp_only_layers": [1]}, dict(async_pipeline=False), GREEDY),  # shared expert, a dense layer
    ("mixtral", {}, dict(max_num_batched_tokens=16, async_pipeline=True), GREEDY),
]
# FP8 checkpoints (32 x 32 blocks: every rank's slice whole blocks), loaded from a folder by each rank
FP8_SCENARIOS = [
    ("llama", {"num_key_value_heads": 4}, dict(max_num_batched_tokens=16, async_pipeline=True), GREEDY),
    ("qwen3_moe", {"num_key_value_heads": 4, "moe_intermediate_size": 64}, dict(async_pipeline=False), GREEDY),
]
BASE = dict(num_kv_blocks=128, block_size=8, max_num_seqs=4)


def _config(size: int, engine: dict) -> EngineConfig:
    return EngineConfig(tensor_parallel_size=size, **{**BASE, **engine})


def _tokens(results) -> list[list[int]]:
    return [r.samples[0].token_ids for r in results]


def _on_ranks(tp, scenarios):
    """Every scenario on this rank: rank 0 generates and digests its sampled ids, the other ranks follow."""
    from batchgen.distributed.follower import follow, token_digest_update

    from batchgen.runner.loader import load_model

    out = []
    for arch, overrides, engine_kw, sampling in scenarios:
        model = load_model(overrides["fp8_folder"], "float32", "cpu") if "fp8_folder" in overrides else \
            make_model(arch, **overrides)
        engine = Engine(model, None, _config(tp.size, engine_kw), tensor_parallel=tp)
        if not tp.is_leader:
            result = follow(engine.runner, tp.plans)
            engine.close()
            out.append((None, result.token_digest, engine.scheduler.num_preemptions))
            continue
        digest, collect = hashlib.sha256(), engine.runner.collect

        def digesting(step, collect=collect, digest=digest):
            output = collect(step)
            token_digest_update(digest, output)
            return output

        engine.runner.collect = digesting
        tokens = _tokens(engine.generate(PROMPTS, sampling))
        out.append((tokens, digest.hexdigest(), engine.scheduler.num_preemptions))
        engine.close()
    return out


@pytest.fixture(scope="module")
def two_rank_runs():
    from batchgen.distributed.spawn import run_group

    return run_group(_on_ranks, 2, SCENARIOS, timeout_s=240)


@pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=[f"{s[0]}-{i}" for i, s in enumerate(SCENARIOS)])
def test_two_ranks_generate_what_one_does_and_sample_alike(two_rank_runs, index):
    arch, overrides, engine_kw, sampling = SCENARIOS[index]
    leader, follower = two_rank_runs[0][index], two_rank_runs[1][index]
    assert leader[1] == follower[1], "the ranks sampled different tokens"
    if engine_kw.get("num_kv_blocks") == 13:
        assert leader[2] > 0, "the scenario meant to preempt did not"
    if sampling.temperature == 0:
        single = Engine(make_model(arch, **overrides), None, _config(1, engine_kw))
        assert leader[0] == _tokens(single.generate(PROMPTS, sampling))
        single.close()


@pytest.fixture(scope="module")
def fp8_two_rank_runs(tmp_path_factory):
    from conftest import make_tokenizer
    from fp8_checkpoints import save_fp8_checkpoint

    from batchgen.distributed.spawn import run_group

    tok = make_tokenizer()
    scenarios = []
    for arch, overrides, engine_kw, sampling in FP8_SCENARIOS:
        folder = save_fp8_checkpoint(make_model(arch, **overrides), tok,  # vocabulary 512: PROMPTS < 500
                                     tmp_path_factory.mktemp("fp8") / arch, "block")
        scenarios.append((arch, {"fp8_folder": str(folder)}, engine_kw, sampling))
    return scenarios, run_group(_on_ranks, 2, scenarios, timeout_s=240)


@pytest.mark.parametrize("index", range(len(FP8_SCENARIOS)), ids=[s[0] for s in FP8_SCENARIOS])
def test_fp8_checkpoints_split_over_two_ranks_generate_what_one_rank_does(fp8_two_rank_runs, index):
    """FP8 weights and their block scales split with their rows (column-parallel) or columns (row-parallel), FP8
    experts along their intermediate dimension: 2 ranks' greedy tokens equal 1 rank's over the same checkpoint."""
    from batchgen.runner.loader import load_model

    scenarios, runs = fp8_two_rank_runs
    _, overrides, engine_kw, sampling = scenarios[index]
    leader, follower = runs[0][index], runs[1][index]
    assert leader[1] == follower[1], "the ranks sampled different tokens"
    single = Engine(load_model(overrides["fp8_folder"], "float32", "cpu"), None, _config(1, engine_kw))
    assert leader[0] == _tokens(single.generate(PROMPTS, sampling))
    single.close()


def _sleep_forever(tp):
    import time

    time.sleep(3600)


def test_sigterm_to_the_launcher_kills_its_ranks(tmp_path):
    """A `timeout` or a scheduler stopping the launching process must not leave ranks running (each would keep its
    GPU's memory): SIGTERM ends run_group, and its cleanup kills them."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = [{os.path.dirname(__file__)!r}, {os.path.dirname(os.path.dirname(__file__))!r}]  # conftest
        from test_tensor_parallel import _sleep_forever
        from batchgen.distributed.spawn import run_group
        print("started", flush=True)
        run_group(_sleep_forever, 2, timeout_s=3600)
    """))
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 60
    children = []
    while time.monotonic() < deadline and len(children) < 2:  # both ranks spawned
        out = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout
        children = [int(pid) for pid in out.split()]
        time.sleep(0.2)
    time.sleep(2)  # the second rank too (a SIGTERM between two starts is cleaned up as well)
    children = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                                   text=True).stdout.split()]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) != 0
    time.sleep(0.5)
    alive = [pid for pid in children if os.path.exists(f"/proc/{pid}") and
             open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert children and not alive, (children, alive)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_each_ranks_expert_slices_sum_to_the_whole_sparse_block(arch):
    """shard_model_ splits every expert along its intermediate dimension (gate and up rows, down columns) and the
    shared expert like a dense MLP, the router whole: the ranks' sparse blocks (transformers' own forward over the
    split weights) sum to the unsplit block's output."""
    import copy

    import torch

    from batchgen.models.shard import shard_model_

    def block_out(mlp, h):
        out = mlp(h)
        return out[0] if isinstance(out, tuple) else out  # [1, T, H]

    model = make_model(arch)
    h = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = model.model.layers[0].mlp
    with torch.no_grad():
        full = block_out(whole, h)
        summed, down_slices = torch.zeros_like(full), []
        for rank in range(2):
            shard = copy.deepcopy(model)
            shard_model_(shard, rank, 2)
            mlp = shard.model.layers[0].mlp
            e, two_i, hidden = whole.experts.gate_up_proj.shape
            assert mlp.experts.gate_up_proj.shape == (e, two_i // 2, hidden)
            assert torch.equal(mlp.gate.weight, whole.gate.weight)  # the router whole on every rank
            down_slices.append(mlp.experts.down_proj)
            summed += block_out(mlp, h)
    assert torch.equal(torch.cat(down_slices, dim=2), whole.experts.down_proj)
    torch.testing.assert_close(summed, full, rtol=1e-5, atol=1e-6)

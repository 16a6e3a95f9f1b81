"""engine.max_num_seqs / max_num_batched_tokens `auto`: the sizing rule (engine/sizing.py), the setting's type,
and the engine choosing its batch at the first step with queued prompts."""

from __future__ import annotations

import pydantic
import pytest

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.engine import sizing
from batchgen.engine.config import Auto
from conftest import make_model, random_prompts

GIB = 1 << 30
# Llama-3.1-8B on an H200: ~110 GiB after the weights, 128 KiB of bf16 K/V a token
H200_KV_TOKENS = 110 * GIB // (128 << 10)
LLAMA_COSTS = sizing.RowCosts(per_seq_bytes=1 << 20, per_batched_token_bytes=4096 * 64)


def test_graph_buckets_step_by_16_to_512_then_by_32_and_end_at_the_largest_batch():
    b = sizing.graph_buckets(1024)
    assert b[:6] == [1, 2, 4, 8, 16, 32] and len(b) == 52
    assert [x for x in b if 480 <= x <= 608] == [480, 496, 512, 544, 576, 608]
    assert b[-1] == 1024 and all(y - x <= 32 for x, y in zip(b, b[1:]))
    assert sizing.graph_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]  # unchanged below 512
    assert sizing.graph_buckets(700)[-2:] == [672, 700]  # a largest batch off the grid is its own bucket
    assert sizing.graph_buckets(1) == [1] and sizing.graph_buckets(3) == [1, 2, 3]


def test_a_size_rounds_down_to_a_bucket_so_a_full_batch_replays_its_own_graph():
    assert sizing.bucket_at_most(1000, 1024) == 992
    assert sizing.bucket_at_most(530, 1024) == 512
    assert sizing.bucket_at_most(300, 1024) == 288
    assert sizing.bucket_at_most(1024, 1024) == 1024
    assert sizing.bucket_at_most(0, 1024) == 1


def test_batched_tokens_follow_the_sequences_from_the_old_default_to_vllms():
    assert [sizing.batched_tokens_for(s) for s in (48, 256, 512, 768, 1024, 4096)] == \
        [8192, 8192, 8192, 12288, 16384, 16384]


def test_capacity_on_cuda_is_1024_where_memory_allows_and_the_cpu_keeps_the_old_default():
    gpu = sizing.capacity(True, None, None, 110 * GIB, LLAMA_COSTS)
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.auto_seqs) == (1024, 16384, True)
    small = sizing.capacity(True, None, None, 2 * GIB, LLAMA_COSTS)  # a tenth of 2 GiB: ~204 rows of 1 MiB
    assert small.max_num_seqs == 192 and "10%" in small.reason
    cpu = sizing.capacity(False, None, None, 0, LLAMA_COSTS)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (256, 8192)


def test_a_number_the_user_set_wins_and_the_other_setting_still_follows_the_rule():
    cap = sizing.capacity(True, 48, None, 110 * GIB, LLAMA_COSTS)
    assert (cap.max_num_seqs, cap.max_num_batched_tokens, cap.auto_seqs, cap.auto_tokens) == (48, 8192, False, True)
    chosen = sizing.choose(cap, H200_KV_TOKENS, [300] * 10, 131072, 48)
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens) == (48, 8192)
    assert chosen.describe() == "max_num_seqs 48; max_num_batched_tokens auto -> 8192"
    cap = sizing.capacity(True, None, 4096, 110 * GIB, LLAMA_COSTS)
    assert (cap.max_num_seqs, cap.max_num_batched_tokens) == (1024, 4096)


def test_the_job_workload_on_an_h200_gets_1024_sequences_and_16384_tokens():
    cap = sizing.capacity(True, None, None, 110 * GIB, LLAMA_COSTS)
    chosen = sizing.choose(cap, H200_KV_TOKENS, [70 + 256] * 1024, 131072, 1024)
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens) == (1024, 16384)
    assert "KV for 2764 x 326 tokens (1024 queued)" in chosen.reason and "graphs to 1024" in chosen.reason
    assert chosen.describe().startswith("max_num_seqs auto -> 1024 (")


def test_longer_sequences_get_the_batch_the_cache_holds_to_the_end_rounded_to_a_graph_bucket():
    cap = sizing.capacity(True, None, None, 110 * GIB, LLAMA_COSTS)
    chosen = sizing.choose(cap, H200_KV_TOKENS, [1500 + 256] * 100, 131072, 1024)
    assert H200_KV_TOKENS // 1756 == 513 and chosen.max_num_seqs == 512
    assert chosen.max_num_batched_tokens == 8192 and chosen.reason.startswith("KV for 513 x 1756 tokens")


def test_a_cache_too_small_for_the_old_default_keeps_it_and_says_why():
    cap = sizing.capacity(True, None, None, 110 * GIB, LLAMA_COSTS)
    chosen = sizing.choose(cap, H200_KV_TOKENS, [8000] * 10, 131072, 1024)
    assert chosen.max_num_seqs == 256 and "preempted" in chosen.reason
    # no queued prompt: the model's context a sequence (the Python API's engine before any request)
    assert sizing.choose(cap, H200_KV_TOKENS, [], 131072, 1024).max_num_seqs == 256
    assert sizing.choose(cap, H200_KV_TOKENS, [], 2048, 1024).max_num_seqs == 432  # 440 rounded to a bucket


def test_a_users_token_budget_bounds_the_sequences_of_a_decode_step():
    cap = sizing.capacity(True, None, 600, 110 * GIB, LLAMA_COSTS)
    chosen = sizing.choose(cap, H200_KV_TOKENS, [326] * 100, 131072, 1024)
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens) == (576, 600)


def test_a_cpu_job_with_auto_runs_todays_cpu_default():
    cap = sizing.capacity(False, None, None, 0, LLAMA_COSTS)
    chosen = sizing.choose(cap, 20_000, [240] * 100, 8192, None)
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens) == (256, 8192)


def test_graph_pool_and_sampler_rows_are_counted_per_sequence():
    without = sizing.seq_row_bytes(128256, 4096, 14336, 6144, 2, 8192, graphs=False)
    with_graphs = sizing.seq_row_bytes(128256, 4096, 14336, 6144, 2, 8192, graphs=True)
    assert without == 16 * 128256
    assert with_graphs - without == 4 * 128256 + (2 * 14336 + 6144 + 3 * 4096) * 2 + 4 * 8192 + 40
    costs = LLAMA_COSTS
    assert costs.reserve_bytes(1024, 16384) == 1025 * (1 << 20) + 16384 * 4096 * 64


def test_auto_is_the_default_reads_as_its_cap_and_is_written_back_as_auto():
    config = EngineConfig()
    assert isinstance(config.max_num_seqs, Auto) and isinstance(config.max_num_batched_tokens, Auto)
    assert (int(config.max_num_seqs), int(config.max_num_batched_tokens)) == (1024, 16384)
    assert 2 * config.max_num_seqs == 2048 and max(4, config.max_num_seqs // 16) == 64  # a bound for row read-ahead
    assert f"(now {config.max_num_seqs})" == "(now auto)"
    dumped = config.model_dump(by_alias=True)
    assert (dumped["max_num_seqs"], dumped["max_num_batched_tokens"]) == ("auto", "auto")
    again = EngineConfig.model_validate(dumped)
    assert isinstance(again.max_num_seqs, Auto) and again == config
    set_ = EngineConfig.model_validate({"max_num_seqs": 48, "max_num_batched_tokens": "auto"})
    assert type(set_.max_num_seqs) is int and set_.max_num_seqs == 48 and isinstance(set_.max_num_batched_tokens, Auto)
    assert EngineConfig.model_validate(set_.model_dump(by_alias=True)) == set_
    with pytest.raises(pydantic.ValidationError, match="positive integer or auto"):
        EngineConfig(max_num_seqs="lots")
    with pytest.raises(pydantic.ValidationError, match="greater than 0"):
        EngineConfig(max_num_seqs=0)


def test_an_auto_cpu_engine_chooses_at_its_first_step_and_says_so(capsys):
    model = make_model("llama")
    prompts = random_prompts((5, 17, 9))
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    with Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=8)) as engine:
        assert (engine.capacity.max_num_seqs, engine.capacity.auto_seqs) == (256, True)
        assert engine.batch_size is None and engine.max_num_seqs == 256
        results = engine.generate(prompts, params)
        assert [len(r.samples[0].token_ids) for r in results] == [4, 4, 4]
        assert (engine.max_num_seqs, engine.max_num_batched_tokens) == (256, 8192)
        assert engine.batch_size.reason.startswith("KV for 34 x 15 tokens (3 queued); not below 256")
        assert engine.stats()["max_num_seqs"] == 256
    err = capsys.readouterr().err
    assert "batchgen: max_num_seqs auto -> 256 (" in err and "max_num_batched_tokens auto -> 8192" in err


def test_an_explicit_cpu_engine_keeps_its_numbers_and_prints_nothing(capsys):
    model = make_model("llama")
    with Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=2,
                                          max_num_batched_tokens=64)) as engine:
        engine.generate(random_prompts((5, 7, 9)), SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True))
        assert (engine.max_num_seqs, engine.max_num_batched_tokens) == (2, 64)
    assert "max_num_seqs auto" not in capsys.readouterr().err

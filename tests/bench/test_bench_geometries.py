"""`batchgen bench --model-geometry`: each geometry builds its transformers config, and the decode floor's byte
count matches the parameters of the model that config makes (counted on the meta device: no memory)."""

from __future__ import annotations

import pytest
import torch

from batchgen.bench.geometries import GEOMETRIES, decode_bytes, model_config


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_decode_bytes_count_every_weight_a_step_reads(name):
    from transformers import AutoModelForCausalLM

    config = model_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    b = decode_bytes(config)
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embed
    params = {id(p): p for p in model.parameters()}  # tied weights once
    norms = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 1)
    read = sum(p.numel() for p in params.values()) - norms - (0 if tied else embed.numel())
    assert abs(b.weight_bytes() - 2 * read) <= 0.001 * 2 * read, (b.weight_bytes(), 2 * read)
    cfg = config.get_text_config()
    assert b.kv_bytes(100) == 100 * len(b.layer_windows) * b.kv_bytes_per_token
    if any(b.layer_windows):  # Gemma2/3: sliding layers read at most their window
        w = cfg.sliding_window
        assert b.kv_bytes(10 * w) < 10 * w * len(b.layer_windows) * b.kv_bytes_per_token
    if b.num_experts:
        assert b.weight_bytes(0) == b.dense_weight_bytes < b.weight_bytes()


def test_an_unknown_geometry_names_the_choices():
    with pytest.raises(ValueError, match="--model-geometry 'llama-9b': one of llama-8b"):
        model_config("llama-9b")


def test_bench_refuses_an_unknown_geometry_before_looking_for_a_gpu():
    from typer.testing import CliRunner

    from batchgen.cli import app

    result = CliRunner().invoke(app, ["bench", "--model-geometry", "gpt-5"])
    assert result.exit_code == 2 and "--model-geometry must be one of llama-8b" in result.output


def test_bench_refuses_an_unknown_variant_before_building_a_model():
    from typer.testing import CliRunner

    from batchgen.cli import app

    result = CliRunner().invoke(app, ["bench", "--variants", "graphs_async,graphs_async_fp8_fast"])
    assert result.exit_code == 2 and "--variants: unknown 'graphs_async_fp8_fast'" in result.output
    assert "graphs_async_fp8_splitk" in result.output  # the list it prints is the bench's own


def test_the_seed_floor_of_llama_8b_counts_weights_kv_and_prefill():
    """W1's floor at ceilings measured on the H200 (4.25 TB/s, 793 TFLOP/s): 4.55 s, as bench/results/ reports."""
    from batchgen.bench.seed import Ceilings, floor_seconds

    floor = floor_seconds(model_config("llama-8b"), 32, 256, 1024, Ceilings(4.25e12, 793e12))
    assert 4.50 < floor < 4.60
    gemma = model_config("gemma2-9b")  # half its layers read at most 4,096 tokens
    long_ctx = floor_seconds(gemma, 32, 8000, 64, Ceilings(4.25e12, 793e12))
    no_window = floor_seconds(model_config("gemma2-9b", sliding_window=None), 32, 8000, 64,
                              Ceilings(4.25e12, 793e12))
    assert long_ctx < no_window


def test_the_fp8_floor_counts_projection_weights_at_one_byte_and_the_lm_head_at_two():
    bf16 = decode_bytes(model_config("llama-8b"))
    fp8 = decode_bytes(model_config("llama-8b", quantization_config={"quant_method": "fp8",
                                                                        "weight_block_size": [128, 128]}))
    head = 128256 * 4096
    assert bf16.dense_weight_bytes - fp8.dense_weight_bytes == (bf16.dense_weight_bytes - 2 * head) // 2
    assert fp8.dense_params == bf16.dense_params and fp8.kv_bytes_per_token == bf16.kv_bytes_per_token
    # MoE: the experts and the projections at one byte; the LM head, norms and routers at two
    bf16, fp8 = decode_bytes(model_config("qwen3-30b-a3b")), decode_bytes(model_config("qwen3-30b-a3b"), 2, 1)
    assert fp8.expert_bytes * 2 == bf16.expert_bytes == 3 * 2048 * 768 * 2
    head, routers, norms = 151936 * 2048, 48 * 128 * 2048, 2048 + 48 * (2 * 2048 + 2 * 128)
    assert bf16.dense_weight_bytes - fp8.dense_weight_bytes == (bf16.dense_weight_bytes - 2 * (head + routers + norms)) // 2


def test_an_fp8_job_limit_times_projection_flops_at_the_fp8_rate_and_the_lm_head_at_bf16():
    """The job bench's limit at 256 sequences is compute-bound: an FP8 checkpoint's projections run at the FP8
    rate measured in the run (2x bf16's here), its LM head at bf16's; without a measured FP8 rate, bf16's."""
    from batchgen.bench.job_run import run_limit_s
    from batchgen.bench.seed import Ceilings

    bf16_cfg = model_config("llama-8b")
    fp8_cfg = model_config("llama-8b", quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    outputs = [{"num_prompt_tokens": 40, "num_completion_tokens": 256}] * 256
    both, bf16_only = Ceilings(4.25e12, 800e12, 1600e12), Ceilings(4.25e12, 800e12)
    b = decode_bytes(fp8_cfg)
    head = 128256 * 4096
    assert b.head_params == head and b.fp8_projections and not decode_bytes(bf16_cfg).fp8_projections
    tokens = 256 * (40 + 256)  # every prompt and generated token through the projections, generated ones the head
    expected = 2 * tokens * (b.dense_params - head) / 1600e12 + 2 * 256 * 256 * head / 800e12
    kv_s = 256 * b.kv_bytes_decoding(40, 256) / 4.25e12
    assert run_limit_s(outputs, fp8_cfg, 256, both) == pytest.approx(expected + kv_s, rel=1e-9)
    assert run_limit_s(outputs, fp8_cfg, 256, bf16_only) == pytest.approx(run_limit_s(outputs, bf16_cfg, 256, both))
    # K/V reads and the LM head are unchanged: the limit falls to ~0.62 of bf16's, not 0.5
    assert 0.55 < run_limit_s(outputs, fp8_cfg, 256, both) / run_limit_s(outputs, bf16_cfg, 256, both) < 0.65
    # an fp8 K/V cache (engine.kv_cache_dtype: fp8): its reads count one byte an element, the rest unchanged
    fp8_kv = run_limit_s(outputs, fp8_cfg, 256, both, kv_element_bytes=1)
    assert decode_bytes(fp8_cfg, kv_element_bytes=1).kv_bytes_per_token * 2 == b.kv_bytes_per_token
    assert fp8_kv == pytest.approx(expected + kv_s / 2, rel=1e-9)


@pytest.mark.parametrize("weights", ["fp8", "fp8-channel"])
def test_a_bench_fp8_model_saves_as_a_checkpoint_that_loads_back_equal(tmp_path, weights):
    """`bench --weights fp8`: the job workload's folder is an FP8 checkpoint batchgen's loader reads back to the
    same weights and logits (a tiny geometry on CPU; partial 128-blocks)."""
    from batchgen.bench.fp8_weights import build_fp8_model, save_fp8_checkpoint
    from batchgen.quant.modules import Fp8Linear
    from batchgen.runner.loader import load_model

    config = model_config("llama-8b", vocab_size=300, hidden_size=192, intermediate_size=320, num_hidden_layers=2,
                          num_attention_heads=6, num_key_value_heads=2, head_dim=32)
    model = build_fp8_model(config, weights, device="cpu")
    save_fp8_checkpoint(model, tmp_path / weights, weights, shard_bytes=200_000)
    assert len(list((tmp_path / weights).glob("*.safetensors"))) > 1
    loaded = load_model(str(tmp_path / weights), "bfloat16", "cpu")
    q = loaded.model.layers[1].self_attn.q_proj
    built = model.model.layers[1].self_attn.q_proj
    assert isinstance(q, Fp8Linear) and torch.equal(q.weight.float(), built.weight.float())
    ids = torch.tensor([[5, 17, 200, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_bench_fp8_moe_model_saves_per_expert_tensors_that_load_back_equal(tmp_path):
    """`bench --weights fp8 --model-geometry qwen3-30b-a3b` at a tiny size: the experts built as Fp8Experts (one byte
    a weight, 128 x 128 blocks), saved per expert as checkpoints store them, loaded back to the same bytes and
    logits (CPU)."""
    from batchgen.bench.fp8_weights import build_fp8_model, save_fp8_checkpoint
    from batchgen.quant.modules import Fp8Experts
    from batchgen.runner.loader import load_model

    config = model_config("qwen3-30b-a3b", vocab_size=300, hidden_size=128, moe_intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_experts=4, num_experts_per_tok=2)
    model = build_fp8_model(config, "fp8", device="cpu")
    built = model.model.layers[1].mlp.experts
    assert isinstance(built, Fp8Experts) and built.gate_up_proj.dtype == torch.float8_e4m3fn
    save_fp8_checkpoint(model, tmp_path / "moe", "fp8", shard_bytes=200_000)
    loaded = load_model(str(tmp_path / "moe"), "bfloat16", "cpu")
    experts = loaded.model.layers[1].mlp.experts
    assert isinstance(experts, Fp8Experts)
    for name in ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"):
        assert torch.equal(getattr(experts, name).float(), getattr(built, name).float()), name
    ids = torch.tensor([[5, 17, 200, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_ab_summary_pairs_the_a_and_b_runs_of_each_configuration():
    """Also an A/B of code (--compare: A is the other checkout's runs, B this one's)."""
    from batchgen.bench.job_run import ab_summary

    runs = [{"code": ".prev" if v == "A" else "this", "max_num_seqs": 256, "repetition_penalty": 1.0, "variant": v,
             "tok_s_end_to_end": t} for v, t in (("A", 100.0), ("B", 80.0), ("B", 90.0), ("A", 110.0))]
    runs.append({"code": "this", "max_num_seqs": 512, "repetition_penalty": 1.0, "variant": "A",
                 "tok_s_end_to_end": 50.0})
    by_seqs = {row["max_num_seqs"]: row for row in ab_summary(runs)}
    assert by_seqs[256]["A_tok_s"] == 105.0 and by_seqs[256]["B_tok_s"] == 85.0
    assert by_seqs[256]["B_over_A"] == round(85 / 105, 4)
    assert by_seqs[512]["B_tok_s"] is None and by_seqs[512]["B_over_A"] is None  # no B run: no figure


def test_an_ab_summary_also_gives_b_over_a_without_the_runs_that_built_kernels_in_their_loop():
    """On the H200 (2026-12-02) the first run of a fresh machine built Triton kernels in its loop (2.1-2.4 s)
    and ran 3-14 % slower than its twin; that run says nothing about its variant."""
    from batchgen.bench.ab import COLD_BUILD_S, variant_means
    from batchgen.bench.job_run import ab_summary

    runs = [{"max_num_seqs": 256, "repetition_penalty": 1.0, "variant": v, "tok_s_end_to_end": t,
             "triton_compile_s": c} for v, t, c in (("A", 60.0, 2.4), ("B", 90.0, 0.0), ("B", 92.0, COLD_BUILD_S),
                                                    ("A", 100.0, 0.02))]
    row, = ab_summary(runs)
    assert row["B_over_A"] == round(91 / 80, 4) and row["num_cold_runs"] == 1
    assert row["B_over_A_warm"] == round(91 / 100, 4)  # the cold A run left out; builds of exactly 0.1 s are warm
    m = variant_means([{"variant": "A", "wall_s": 3.0, "triton_compile_s": 1.0}, {"variant": "B", "wall_s": 2.0}],
                      "wall_s")
    assert m["A"] == 3.0 and m["A_warm"] is None and m["B_warm"] == 2.0  # no warm A run: no warm figure
    row, = ab_summary([{**r, "triton_compile_s": 1.0} if r["variant"] == "A" else r for r in runs])
    assert row["B_over_A_warm"] is None


def test_window_rates_of_a_throughput_log_see_a_run_that_slows_down(tmp_path):
    """The long-run check compares the middle tenth of the rows with the last tenths."""
    import json

    from batchgen.bench.job_run import window_tok_s

    records, t, tokens = [], 0.0, 0
    for rows_done in range(0, 1001, 25):  # 100 tokens a row; the last fifth of the rows at half the rate
        records.append({"rows_done": rows_done, "num_generated_tokens": tokens, "elapsed_s": t})
        tokens += 2500
        t += 1.0 if rows_done < 800 else 2.0
    (tmp_path / "log.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    log = tmp_path / "log.jsonl"
    assert window_tok_s(log, 1000, 0.45, 0.55) == pytest.approx(2500.0)
    assert window_tok_s(log, 1000, 0.9, 1.0) == pytest.approx(1250.0)
    assert window_tok_s(log, 1000, 0.999, 1.0) is None  # one record: no rate
    # a short run's final record at the last periodic record's time (a job bench run failed on it)
    records.append({**records[-1], "rows_done": 1000})
    records[-2]["rows_done"] = 990
    log.write_text("\n".join(json.dumps(r) for r in records[-2:]))
    assert window_tok_s(log, 1000, 0.9, 1.0) is None


def test_the_seed_summary_lists_a_refused_variant_beside_the_ones_that_ran():
    """A variant whose engine setting the device refuses (engine.fp8_gemm: blockwise without cuBLASLt's block-wise
    scaling) is a row saying so; the table still shows the floor and the other runs."""
    from batchgen.bench.seed import summary_table

    report = {"floor_s": 2.0, "floor_tok_s": 100.0,
              "ours_sync_graphs_async_fp8_blockwise": {"refused": "engine.fp8_gemm: blockwise: ..."},
              "ours_sync_graphs_async_fp8_splitk": {"wall_s": 3.0, "tok_s": 66.7, "kernels_per_decode_step": 537}}
    lines = summary_table(report).splitlines()
    assert lines[2].split() == ["ours_sync_graphs_async_fp8_blockwise", "refused"]
    assert lines[3].split() == ["ours_sync_graphs_async_fp8_splitk", "3.00", "67", "1.50", "537"]


def test_the_job_bench_splits_a_loop_into_decode_mixed_and_idle_shares_of_its_wall_time():
    from batchgen.bench.job_run import step_kinds

    stats = {"num_decode_steps": 200, "num_mixed_steps": 10, "num_prefill_tokens": 5000, "gpu_busy_s_decode": 1.8,
             "gpu_busy_s_mixed": 0.5, "gpu_idle_s_before_decode": 0.02, "gpu_idle_s_before_mixed": 0.08,
             "gpu_idle_max_s": 0.0123, "num_gpu_idle_over_1ms": 3}
    kinds = step_kinds(stats, wall_s=2.5)
    assert kinds["gpu_ms_per_decode_step"] == 9.0 and kinds["gpu_ms_per_mixed_step"] == 50.0
    assert kinds["share_busy_decode"] == 0.72 and kinds["share_idle_before_mixed"] == 0.032
    assert kinds["gpu_idle_max_ms"] == 12.3 and kinds["num_gpu_idle_over_1ms"] == 3
    assert step_kinds({"gpu_busy_s": 1.0}, 2.0) == {}  # a report from before the counters


def test_the_mixed_kernel_diff_ranks_kernels_by_how_much_more_time_the_second_run_spent(monkeypatch):
    """bench/mixed_kernels.py --compare: the tool that found the mixed load's decode attention regression
    (bench/results/2026-12-02-mixed-regression-decode-launch.md)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import mixed_kernels

    a = {"kernels": {"decode": {"us": 9_000.0, "count": 32}, "silu": {"us": 400.0, "count": 32},
                     "gemm": {"us": 3_000.0, "count": 7}}}
    b = {"kernels": {"decode": {"us": 10_000.0, "count": 32}, "gated_act": {"us": 390.0, "count": 32},
                     "gemm": {"us": 2_950.0, "count": 7}}}
    rows = mixed_kernels.compare(a, b)
    assert [r["name"] for r in rows] == ["decode", "silu", "gated_act", "gemm"]
    assert rows[0] == {"name": "decode", "a_ms": 9.0, "b_ms": 10.0, "a_count": 32, "b_count": 32, "delta_ms": 1.0}
    assert rows[1]["b_count"] == 0 and rows[2]["a_ms"] == 0.0  # a kernel of one run only
    assert len(mixed_kernels.compare(a, b, top=2)) == 2


def test_the_mixed_bench_times_its_load_after_a_warm_up_and_reports_the_timed_runs_steps_alone(monkeypatch):
    """batchgen bench --workload mixed (run here on CPU, its CUDA synchronisation made a no-op): the warm-up's
    requests are not in the timed run's steps or step kinds and leave nothing in the prefix cache for it, every
    request gets its exact length, and the Triton builds inside the timed run are reported (none on CPU)."""
    import torch

    from batchgen.bench import mixed
    from conftest import make_model, random_prompts

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    monkeypatch.setattr(mixed, "WARMUP_REQUESTS", 3)
    monkeypatch.setattr(mixed, "WARMUP_TOKENS", 2)
    prompts = random_prompts([45, 9, 37, 70, 4, 33])  # over a 16-token block: a warm-up on them would be cached
    output_lens = [3, 6, 2, 5, 4, 1]
    report = mixed.run_ours(make_model(), prompts, output_lens, max_num_seqs=4)
    assert report["all_lengths_exact"] and report["tokens"] == sum(output_lens)
    kinds = report["step_kinds"]
    # every prompt token computed in the timed run: the warm-up's steps not counted, its prompts not cached for it
    assert kinds["num_prefill_tokens"] == sum(map(len, prompts))
    assert kinds["num_decode_steps"] + kinds["num_mixed_steps"] == report["steps"]
    assert report["triton_compile_s"] == 0.0 and report["triton_kernels_compiled"] == {}
    assert mixed.counters_since({"a": 1, "b": 2.5, "gpu_idle_max_s": 0.1}, {"a": 4, "b": 3.0, "gpu_idle_max_s": 0.3,
                                                                            "name": "x"}) == {"a": 3, "b": 0.5}


def test_idle_between_kernels_is_charged_to_the_kernel_that_waited(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import mixed_kernels

    intervals = [("gemm", 0.0, 10.0), ("attn", 12.0, 20.0),  # 2 µs idle before attn
                 ("copy", 15.0, 30.0),  # overlaps attn: no idle, and the device is busy until 30
                 ("gemm", 150.0, 160.0),  # 120 µs idle before it (a long stretch)
                 ("attn", 160.0, 170.0)]  # starts as gemm ends: no idle
    gaps = mixed_kernels.gaps_by_next_kernel(list(reversed(intervals)))  # any order in, sorted by start
    assert gaps["idle_us"] == 122.0
    assert gaps["by_kernel"] == {"attn": {"us": 2.0, "count": 1, "count_over_long": 0},
                                 "gemm": {"us": 120.0, "count": 1, "count_over_long": 1}}


def test_the_prefill_profile_builds_a_mixed_step_of_decode_rows_beside_a_prompt(monkeypatch):
    """bench/profile_prefill.py TOKENSxLEN/DxC (run here on CPU, a tiny model): the profiled step holds exactly the
    prompt tokens and the decode rows asked for (profile_shape asserts both), and its floor adds the decode rows'
    K/V bytes."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import profile_prefill

    from batchgen.bench.geometries import decode_bytes
    from batchgen.bench.seed import Ceilings
    from conftest import make_model

    assert profile_prefill.parse_shape("1450x1450/250x1365") == (1450, 1450, 250, 1365)
    assert profile_prefill.parse_shape("8192x68") == (8192, 68, 0, 0)
    for bad in ("8192", "8x68/3", "0x5", "8x4/2x2", "axb"):
        with pytest.raises(SystemExit, match="--shapes"):
            profile_prefill.parse_shape(bad)
    model = make_model()
    ceilings = Ceilings(copy_bytes_s=1e9, matmul_flop_s=1e12)
    plain = profile_prefill.profile_shape(model, 24, 12, 1, ceilings)
    mixed = profile_prefill.profile_shape(model, 24, 12, 1, ceilings, num_decode=5, decode_context=40)
    assert (mixed["num_prompts"], mixed["num_decode"], mixed["decode_context"]) == (2, 5, 40)
    assert mixed["decode_contexts_min_median_max"] == [40, 40, 40]
    kv_ms = 1e3 * 5 * decode_bytes(model.config).kv_bytes(40) / ceilings.copy_bytes_s
    assert mixed["attention_floor_ms"] == pytest.approx(plain["attention_floor_ms"] + kv_ms, abs=0.02)
    # decode prompts over one step's budget (9 x 998 tokens > 8,192): rows prefilled early decode meanwhile, so
    # their contexts spread; each row's own counts in the floor
    long_model = make_model(max_position_embeddings=4096)
    spread = profile_prefill.profile_shape(long_model, 24, 12, 1, ceilings, num_decode=9, decode_context=1000)
    low, median, high = spread["decode_contexts_min_median_max"]
    assert low == 1000 and high > 1000
    assert spread["attention_floor_ms"] > plain["attention_floor_ms"] + 1e3 * 9 * decode_bytes(
        long_model.config).kv_bytes(1000) / ceilings.copy_bytes_s


def test_the_mixed_bench_ab_takes_engine_settings_only_and_refuses_bad_ones_before_building_a_model():
    from batchgen.bench.mixed import bench_engine_config, engine_overrides
    from batchgen.errors import JobError

    assert engine_overrides(["engine.max_num_batched_tokens=16384", "engine.async=false"], 256) == {
        "max_num_batched_tokens": 16384, "async": False}
    config = bench_engine_config(256, {"async_pipeline": False, "graph_blas_library": "cublas"})
    assert (config.async_pipeline, config.graph_blas_library, config.max_num_batched_tokens) == (False, "cublas", 8192)
    for bad, match in (("sampling.temperature=0", "engine.KEY=VALUE only"),
                       ("engine.max_num_seqs=64", "--max-num-seqs"),
                       ("engine.graph_blas_library=magic", "engine.graph_blas_library"),
                       ("engine.no_such_knob=1", "engine.no_such_knob"),
                       ("engine", "--ab-set 'engine': expected KEY.PATH=VALUE"),
                       ("engine.async=maybe", "engine.async:")):
        with pytest.raises(JobError, match=match):
            engine_overrides([bad], 256)
    with pytest.raises(JobError, match="one setting"):
        engine_overrides(["engine.async=false", "engine.async_pipeline=true"], 256)


def test_the_mixed_cli_refuses_a_bad_ab_set_with_a_message_naming_it():
    from typer.testing import CliRunner

    from batchgen.cli import app

    result = CliRunner().invoke(app, ["bench", "--workload", "mixed", "--ab-set", "engine.max_num_seqs=64"])
    assert result.exit_code == 2 and "--max-num-seqs" in result.output
    result = CliRunner().invoke(app, ["bench", "--workload", "seed", "--ab-set", "engine.async=false"])
    assert result.exit_code == 2 and "--ab-set to job and mixed" in result.output


def test_the_mixed_bench_ab_runs_a_b_b_a_with_the_sets_on_b_only(monkeypatch):
    import torch

    from batchgen.bench import mixed
    from conftest import make_model, random_prompts

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    monkeypatch.setattr(mixed, "WARMUP_REQUESTS", 2)
    monkeypatch.setattr(mixed, "WARMUP_TOKENS", 2)
    prompts, output_lens = random_prompts([30, 20, 40]), [3, 5, 2]
    released, saved = [], []
    monkeypatch.setattr(mixed, "release", lambda engine: (released.append(engine), engine.close()))
    real_run, calls = mixed.run_ours, []

    def first_run_builds(*args, **kwargs):  # the first run of a fresh machine: Triton builds inside its loop
        calls.append(1)
        return {**real_run(*args, **kwargs), **({"triton_compile_s": 2.0} if len(calls) == 1 else {})}

    monkeypatch.setattr(mixed, "run_ours", first_run_builds)
    ab = mixed.ab_runs(make_model(), prompts, output_lens, 4, {"max_num_batched_tokens": 16}, floor=1.0,
                       after_run=lambda runs: saved.append(len(runs)))
    assert [r["variant"] for r in ab["runs"]] == list("ABBA")
    assert len(released) == 4 and saved == [1, 2, 3, 4]  # every engine given back, the report saved after each run
    # 16 tokens a step chunk the 90 prompt tokens: B takes more steps than A, the same tokens
    a_steps, b_steps = ab["runs"][0]["steps"], ab["runs"][1]["steps"]
    assert b_steps > a_steps and all(r["all_lengths_exact"] for r in ab["runs"])
    assert ab["runs"][3]["steps"] == a_steps and ab["runs"][2]["steps"] == b_steps
    assert ab["B_over_A"] == pytest.approx(ab["B_wall_s"] / ab["A_wall_s"])
    assert ab["num_cold_runs"] == 1 and ab["A_wall_s_warm"] == ab["runs"][3]["wall_s"]  # the cold first A left out
    assert ab["B_over_A_warm"] == pytest.approx(ab["B_wall_s"] / ab["runs"][3]["wall_s"])


def test_the_prefill_profile_gives_each_gemm_shapes_rate(monkeypatch):
    from pathlib import Path
    from types import SimpleNamespace as Avg

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import profile_prefill

    averages = [Avg(key="aten::linear", input_shapes=[[1700, 4096], [6144, 4096], []], count=64,
                    device_time_total=2 * 32 * 128.0),  # 2 reps of 32 layers, 128 us a call
                Avg(key="aten::linear", input_shapes=[[1700, 4096], [4096, 4096], []], count=64,
                    device_time_total=2 * 32 * 100.0),
                Avg(key="aten::mm", input_shapes=[[8, 8], [8, 8]], count=2, device_time_total=5.0),  # not F.linear
                Avg(key="aten::linear", input_shapes=[[2, 3, 4], [5, 4], []], count=2, device_time_total=1.0)]
    rows = profile_prefill.gemm_shapes(averages, reps=2)
    assert [(r["M"], r["N"], r["K"], r["calls"]) for r in rows] == [(1700, 6144, 4096, 32), (1700, 4096, 4096, 32)]
    assert rows[0]["ms"] == pytest.approx(32 * 0.128)
    assert rows[0]["TFLOPs"] == pytest.approx(2 * 1700 * 6144 * 4096 / 128e-6 / 1e12, rel=1e-3)

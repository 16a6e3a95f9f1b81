"""The engine on a CUDA GPU (skipped elsewhere): exact against transformers in fp32 through the Triton
decode kernel, and usable in bf16."""

from __future__ import annotations

import pytest
import torch

from batchgen import Engine, EngineConfig, SamplingParams
from conftest import ARCHS, MOE_ARCHS, hf_greedy, make_model, random_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fused", [True, False])  # our fused decode forward, or transformers' modules
@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_on_gpu_matches_transformers_generate_fp32(arch, cuda_graphs, fused):
    model = make_model(arch).cuda()
    prompts = random_prompts((5, 17, 33, 8, 64, 1))  # 6 sequences: the graph bucket of 8 pads 2 rows
    expected = [hf_greedy(model, p, 16) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=32,
                                              cuda_graphs=cuda_graphs, fused_decoder=fused))
    assert engine.runner.decode_forward.is_fused == fused
    assert engine.runner.use_triton and (engine.runner.graphs is not None) == cuda_graphs
    got = [r.samples[0].token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0,
                                                                                   ignore_eos=True))]
    assert got == expected


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_greedy_on_gpu_through_the_grouped_gemm_kernels_matches_transformers_generate_fp32(arch, cuda_graphs):
    """The fused MoE forward on the device: routing, align and grouped GEMMs (fp32, IEEE dots) replayed from the
    decode graphs at a padded bucket, prefill through forward_packed."""
    model = make_model(arch).cuda()
    # transformers' reference through its batched_mm experts (bmm: any dtype on CUDA; generate switches its decode
    # steps to it anyway), not grouped_mm, whose CUDA kernel may take bf16 only
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("batched_mm")
    prompts = random_prompts((5, 17, 33, 8, 64, 1))
    expected = [hf_greedy(model, p, 16) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=32,
                                              cuda_graphs=cuda_graphs))
    assert engine.decode_path == "fused" and (engine.runner.graphs is not None) == cuda_graphs
    got = [r.samples[0].token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0,
                                                                                   ignore_eos=True))]
    assert got == expected


def test_seeded_sampling_on_gpu_is_batch_independent_bf16():
    model = make_model("llama").cuda().to(torch.bfloat16)
    target = random_prompts((21,), seed=5)[0]
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    alone = Engine(model, None, EngineConfig(num_kv_blocks=64)).generate([target], params)[0].samples[0].token_ids
    others = random_prompts((3, 40, 11), seed=6)
    mixed = Engine(model, None, EngineConfig(num_kv_blocks=64)).generate(others + [target], params)
    assert len(alone) == 16
    # bf16 batched matmuls may round differently by batch size; require agreement on most tokens
    same = sum(a == b for a, b in zip(alone, mixed[-1].samples[0].token_ids))
    assert same >= 12


def test_compiled_graphed_decode_matches_transformers_generate_fp32():
    model = make_model("qwen3").cuda()
    prompts = random_prompts((5, 17, 33, 8, 64, 1, 9, 2, 40))  # 9 sequences: bucket 16
    expected = [hf_greedy(model, p, 12) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=32, compile=True))
    got = [r.samples[0].token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0,
                                                                                   ignore_eos=True))]
    assert got == expected


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_async_pipeline_on_gpu_matches_transformers_fp32(cuda_graphs):
    model = make_model("llama").cuda()
    prompts = random_prompts((5, 17, 33, 8, 64, 1, 40))
    expected = [hf_greedy(model, p, 20) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=32,
                                              cuda_graphs=cuda_graphs, async_pipeline=True))
    got = [r.samples[0].token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0,
                                                                                   ignore_eos=True))]
    assert got == expected


@pytest.mark.parametrize("arch,fused", [("llama", True), ("qwen3", True), ("llama", False)])  # False: transformers'
def test_async_pipeline_on_gpu_samples_exactly_what_the_sync_engine_samples(arch, fused):  # modules in the graphs
    """Seeded sampling with every option that needs sampling tensors staged per step (temperature, top-k/p,
    min-p, suppressed EOS before min_new_tokens, repetition penalty): async == sync, token for token."""
    model = make_model(arch).cuda()
    prompts = random_prompts((5, 17, 33, 8, 64, 1, 40, 23, 11), seed=3)
    params = [SamplingParams(max_new_tokens=24, temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=i,
                             min_new_tokens=6, repetition_penalty=1.2 if i % 3 == 0 else 1.0,
                             presence_penalty=0.5 if i % 3 == 1 else 0.0, frequency_penalty=0.7 if i % 4 == 1 else 0.0,
                             logit_bias={7: 2.0, 9: -100.0} if i % 2 else {})
              for i in range(len(prompts))]
    runs = []
    for async_pipeline in (False, True):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=32,
                                                  async_pipeline=async_pipeline, fused_decoder=fused))
        runs.append([r.samples[0].token_ids for r in engine.generate(prompts, params)])
    assert runs[0] == runs[1]
    assert all(len(t) >= 6 for t in runs[0])


def test_dispatching_a_step_never_makes_a_synchronising_cuda_call():
    """The async pipeline's premise: queuing a step (staged inputs, prefill or graphed decode, sampling with
    top-p, suppressed EOS and a repetition penalty, the penalty table's marks) never waits for the device; only
    `collect` does. torch's sync debug mode raises on any synchronising call (a host scalar copied into a
    device tensor, `.item()`, a pageable copy)."""
    model = make_model("llama").cuda()
    prompts = random_prompts((5, 17, 33, 8, 64, 1, 40), seed=4)
    params = [SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=i, min_new_tokens=4,
                             repetition_penalty=1.3 if i % 2 else 1.0, presence_penalty=0.4 if i % 3 == 0 else 0.0,
                             frequency_penalty=0.6 if i % 3 == 1 else 0.0, logit_bias={5: 1.5} if i % 2 else {})
              for i in range(len(prompts))]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=32, async_pipeline=True))
    dispatch = engine.runner.dispatch
    calls = []

    def strict_dispatch(batch, *rest):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return dispatch(batch, *rest)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            calls.append(batch.num_prefill_tokens)

    engine.generate(prompts, params)  # warm: kernels compiled, staging and the penalty table allocated
    engine.runner.dispatch = strict_dispatch
    results = engine.generate(prompts, params)
    assert all(len(r.samples[0].token_ids) == 16 for r in results)
    assert any(n > 0 for n in calls) and any(n == 0 for n in calls)  # prefill and decode steps both ran
    # a cache too small for all: preempted penalised sequences come back and resend prompt + output counts
    small = Engine(model, None, EngineConfig(num_kv_blocks=12, block_size=8, max_num_seqs=4, async_pipeline=True))
    small.generate(prompts, params)
    dispatch = small.runner.dispatch
    small.runner.dispatch = strict_dispatch
    small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_steps_on_gpu_split_decodes_from_prefill_chunks_exactly_fp32(arch):
    """A 20-token budget interleaves decodes with prefill chunks in most steps: the decode rows (packed
    first) run the Triton kernel, the chunks the reference; greedy still equals transformers."""
    model = make_model(arch).cuda()
    prompts = random_prompts((5, 47, 33, 8, 64, 1, 40), seed=4)
    expected = [hf_greedy(model, p, 10) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=32,
                                              max_num_batched_tokens=20))
    got = [r.samples[0].token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0,
                                                                                   ignore_eos=True))]
    assert got == expected


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])  # softcap + sliding window; fused QKV module of its own
def test_prefill_kernel_serves_softcap_and_sliding_window_models_exactly_fp32(arch):
    from test_engine_exact import _more_archs

    config_cls, model_cls, extra = _more_archs()[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)).eval().cuda()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    prompts = random_prompts((5, 30, 12, 41))
    expected = [hf_greedy(model, p, 24) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=24,
                                              cuda_graphs=False))
    got = [r.samples[0].token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0,
                                                                                   ignore_eos=True))]
    assert got == expected


@pytest.mark.parametrize("blas", ["cublaslt", "cublas", None])
def test_graphs_captured_with_either_blas_library_match_transformers_and_restore_the_default_fp32(blas):
    model = make_model("llama").cuda()
    prompts = random_prompts((5, 17, 33, 8, 64, 1))
    expected = [hf_greedy(model, p, 16) for p in prompts]
    before = torch.backends.cuda.preferred_blas_library()
    engine = Engine(model, None, EngineConfig(num_kv_blocks=128, max_num_seqs=32, graph_blas_library=blas))
    assert torch.backends.cuda.preferred_blas_library() == before  # the capture's choice does not leak
    assert engine.runner.graphs.blas_library == blas
    got = [r.samples[0].token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0,
                                                                                   ignore_eos=True))]
    assert got == expected


def test_step_timing_splits_device_time_by_kind_and_sums_to_the_busy_total():
    model = make_model("llama").cuda()
    prompts = random_prompts((5, 17, 33, 8, 64, 1, 40), seed=2)
    with Engine(model, None, EngineConfig(num_kv_blocks=128, block_size=16, max_num_seqs=4,
                                          max_num_batched_tokens=32)) as engine:
        engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
        stats = engine.stats()
    assert stats["num_mixed_steps"] > 0 and stats["num_decode_steps"] > 0
    assert stats["gpu_busy_s_decode"] > 0 and stats["gpu_busy_s_mixed"] > 0
    assert stats["gpu_busy_s"] == pytest.approx(stats["gpu_busy_s_decode"] + stats["gpu_busy_s_mixed"], abs=2e-3)
    assert stats["gpu_idle_s_before_decode"] >= 0 and stats["gpu_idle_s_before_mixed"] >= 0

"""engine.deterministic: a row's sampled tokens (temperature 0.7, top_p 0.9) and their log-probs are bitwise the
same whatever max_num_seqs, the other rows, the chunked-prefill size, a prefix-cache hit or a preemption.

Every invariance test runs twice: deterministic (everything equal) and default (the same comparison must find a
difference, so the test cannot pass vacuously). What the default mode changes, measured on CPU with torch 2.13:
fp32 GEMMs run M = 1 as a GEMV and M >= 3 as a GEMM (other roundings), and the reference attention's shapes
follow the step's longest sequence. In fp32 those 1-ulp differences show in the log-probs (0 of 8 rows identical
between max_num_seqs 1 and 3) but seldom flip a sampled token (8 of 8 token lists identical); in bf16 they flip
tokens too (7 of 8 identical), so the bf16 cases compare tokens, the fp32 ones log-probs as well."""

from __future__ import annotations

import pytest
import torch

from batchgen import Engine, SamplingParams
from batchgen.engine.config import EngineConfig
from conftest import make_model, random_prompts

PROMPT_LENS = [5, 17, 33, 9, 24, 40, 12, 3]


@pytest.fixture(scope="module")
def models():
    base = make_model("llama", vocab_size=512)
    return {torch.float32: base, torch.bfloat16: make_model("llama", vocab_size=512).to(torch.bfloat16)}


def _params(n: int = 1, first_seed: int = 100) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, seed=first_seed + i, logprobs=0,
                           ignore_eos=True, n=n) for i in range(len(PROMPT_LENS))]


def _generate(model, prompts, params, deterministic: bool, **knobs):
    """[(token ids, log-probs)] per sample, prompts in order."""
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=128, block_size=8)
    cfg.update(knobs)
    with Engine(model, None, EngineConfig(deterministic=deterministic, **cfg)) as engine:
        results = engine.generate(prompts, params)
    return [(s.token_ids, s.logprobs) for r in results for s in r.samples]


def _assert_same_iff_deterministic(a, b, deterministic: bool, dtype) -> None:
    """Deterministic: every sample's tokens and log-probs equal. Default: some differ (the log-probs in fp32, the
    tokens in bf16: see the module's note)."""
    assert len(a) == len(b)
    if deterministic:
        assert a == b
    elif dtype == torch.float32:
        assert [lp for _, lp in a] != [lp for _, lp in b], "the default mode no longer differs: pick other shapes"
    else:
        assert [t for t, _ in a] != [t for t, _ in b], "the default mode no longer differs: pick other shapes"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_a_rows_samples_do_not_depend_on_max_num_seqs(models, dtype, deterministic):
    prompts = random_prompts(PROMPT_LENS, seed=1)
    alone = _generate(models[dtype], prompts, _params(), deterministic, max_num_seqs=1)
    for seqs in (3, 8):
        _assert_same_iff_deterministic(alone, _generate(models[dtype], prompts, _params(), deterministic,
                                                        max_num_seqs=seqs), deterministic, dtype)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_a_rows_samples_do_not_depend_on_the_other_rows_of_its_batch(models, deterministic):
    """The first four prompts with two different sets of companions (other lengths, n = 2 samples each)."""
    prompts = random_prompts(PROMPT_LENS, seed=1)
    companions = random_prompts([60, 2, 31, 7], vocab_size=512, seed=9)
    mine = _generate(models[torch.float32], prompts[:4], _params(n=2)[:4], deterministic)
    crowded = _generate(models[torch.float32], prompts[:4] + companions, _params(n=2), deterministic)
    _assert_same_iff_deterministic(mine, crowded[:8], deterministic, torch.float32)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_a_rows_samples_do_not_depend_on_the_chunked_prefill_size(models, deterministic):
    """max_num_batched_tokens 16: every prompt over 16 tokens is prefilled in chunks, beside other rows' decodes;
    512: whole prompts at once."""
    prompts = random_prompts(PROMPT_LENS, seed=2)
    chunked = _generate(models[torch.float32], prompts, _params(), deterministic, max_num_batched_tokens=16)
    whole = _generate(models[torch.float32], prompts, _params(), deterministic, max_num_batched_tokens=512)
    _assert_same_iff_deterministic(chunked, whole, deterministic, torch.float32)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_a_prefix_cache_hit_reproduces_a_cold_run(models, deterministic):
    """Prompt B is 4 full blocks (32 tokens) that prompt A starts with, and one token more: after A, B takes the
    blocks from the prefix cache (its num_cached_tokens says so) and prefills its last token alone (in the default
    mode an M = 1 GEMM: another kernel); a fresh engine prefills all 33."""
    model = models[torch.float32]
    shared, tail_a, tail_b = random_prompts([32, 5, 1], seed=3)
    params = _params()[0]
    cfg = EngineConfig(deterministic=deterministic, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64,
                       block_size=8)
    with Engine(model, None, cfg) as engine:
        engine.generate([shared + tail_a], params)
        warm = engine.generate([shared + tail_b], params)[0].samples[0]
    assert warm.num_cached_tokens == 32
    with Engine(model, None, cfg) as engine:
        cold = engine.generate([shared + tail_b], params)[0].samples[0]
    assert cold.num_cached_tokens == 0
    _assert_same_iff_deterministic([(warm.token_ids, warm.logprobs)], [(cold.token_ids, cold.logprobs)],
                                   deterministic, torch.float32)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_preemption_and_recomputation_do_not_change_a_rows_samples(models, deterministic):
    """A KV cache of 12 blocks of 8 for 8 rows of up to 56 tokens: rows are preempted and recomputed (their
    generated tokens then run through prefill, not decode) and still sample what an ample cache samples."""
    prompts = random_prompts(PROMPT_LENS, seed=4)
    ample = _generate(models[torch.float32], prompts, _params(), deterministic, num_kv_blocks=128)
    cfg = EngineConfig(deterministic=deterministic, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=12,
                       block_size=8)
    with Engine(models[torch.float32], None, cfg) as engine:
        results = engine.generate(prompts, _params())
        assert engine.scheduler.num_preemptions > 0
    _assert_same_iff_deterministic([(s.token_ids, s.logprobs) for r in results for s in r.samples], ample,
                                   deterministic, torch.float32)


def test_configurations_without_batch_invariant_kernels_are_refused_naming_the_key():
    for knobs in (dict(compile=True), dict(fused_decoder=False), dict(tensor_parallel_size=2)):
        with pytest.raises(ValueError, match="engine.deterministic"):
            EngineConfig(deterministic=True, **knobs)
    cfg = EngineConfig(deterministic=True, num_kv_blocks=16, block_size=8)
    for model in (make_model("qwen3_moe"), make_model("llama", hidden_act="gelu")):  # MoE; transformers' modules
        with pytest.raises(ValueError, match="^engine.deterministic: "):
            Engine(model, None, cfg)


def test_deterministic_mode_refuses_a_graph_blas_library_other_than_the_one_its_gemms_pin():
    """Its GEMMs run on cuBLASLt eagerly and in every graph (kernels/invariant/fixed_row_gemm.py): `cublas` would be
    silently overridden, so it is refused; the default and None pass."""
    with pytest.raises(ValueError, match="engine.deterministic .*engine.graph_blas_library: cublas "):
        EngineConfig(deterministic=True, graph_blas_library="cublas")
    EngineConfig(graph_blas_library="cublas")  # the default mode takes it
    for library in ("cublaslt", None):
        assert EngineConfig(deterministic=True, graph_blas_library=library).graph_blas_library == library


@pytest.mark.gpu
def test_sampled_tokens_on_gpu_are_the_same_at_max_num_seqs_4_and_64_with_graphs_and_async_bf16():
    model = make_model("llama", vocab_size=512, num_layers=4).to("cuda", torch.bfloat16)
    prompts = random_prompts([7 + (i * 13) % 90 for i in range(48)], seed=5)
    params = [SamplingParams(max_new_tokens=48, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    runs = {}
    for seqs in (4, 64):
        cfg = EngineConfig(deterministic=True, max_num_seqs=seqs, max_num_batched_tokens=256, cuda_graphs=True,
                           async_pipeline=True, num_kv_blocks=1024, block_size=16)
        with Engine(model, None, cfg) as engine:
            assert engine.runner.graphs is not None and engine.async_pipeline
            runs[seqs] = [r.samples[0].token_ids for r in engine.generate(prompts, params)]
    assert runs[4] == runs[64]


DETERMINISTIC_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
                       "granite", "starcoder2")


@pytest.mark.parametrize("arch", DETERMINISTIC_ARCHS)
def test_deterministic_decoders_never_reach_torchs_batch_dependent_linear(arch, monkeypatch):
    """Every GEMM of a deterministic step (packed prefill and decode, LM head included) goes through the
    batch-invariant kernel: F.linear is never called but by that kernel's own one-row CPU path, while the default
    mode does call it (the probe is live)."""
    import sys

    import torch.nn.functional as F

    calls = []
    real = F.linear

    def counting(*args, **kwargs):
        if not sys._getframe(1).f_code.co_filename.endswith("kernels/invariant/matmul.py"):
            calls.append(sys._getframe(1).f_code.co_filename)
        return real(*args, **kwargs)

    model = make_model(arch, vocab_size=512)
    prompts = random_prompts([7, 12], seed=3)
    params = SamplingParams(max_new_tokens=3, temperature=0.7, seed=1, ignore_eos=True)
    for deterministic in (False, True):
        with Engine(model, None, EngineConfig(deterministic=deterministic, max_num_seqs=2, num_kv_blocks=32,
                                              block_size=8)) as engine:
            monkeypatch.setattr(F, "linear", counting)
            calls.clear()
            engine.generate(prompts, params)
            monkeypatch.setattr(F, "linear", real)
        assert (len(calls) == 0) == deterministic, (arch, deterministic, len(calls))


def test_deterministic_mode_refuses_an_fp8_checkpoint_before_loading():
    from transformers import LlamaConfig

    from batchgen.models.registry import deterministic_reason

    config = LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)
    assert deterministic_reason(config) is None
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    assert "FP8" in deterministic_reason(config)

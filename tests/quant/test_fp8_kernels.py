"""The FP8 GEMM kernels against their torch references: under TRITON_INTERPRET=1 on CPU, on a GPU in bf16 (random
activations, CUDA-graph capture, the engine end to end); which path fp8_linear takes (CPU, the probe monkeypatched).

The interpreter (Triton 3.6) rounds float32 -> float8e4nv wrongly where the rounding carries into the exponent
(124.3 becomes 64, not 128), so its check uses activations whose quantisation is exact (each token group: fp8
grid values with absolute max 448, times a power of two): any error of indexing, scales or accumulation still
shows; the rounding itself is covered on the GPU. Triton 3.6's interpreter also needs numpy < 2.4 (with 2.4+ it
fails in its own code: "only 0-dimensional arrays can be converted to Python scalars"): the test is skipped there."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from conftest import needs_interpreter, run_under_interpreter  # noqa: E402

from batchgen.kernels.fp8.blockwise import blockwise_scaled_mm, blockwise_scaled_mm_supported  # noqa: E402
from batchgen.kernels.fp8.gemm import block_scaled_matmul, fp8_linear, gemm_path, rowwise_scaled_mm  # noqa: E402
from batchgen.kernels.fp8.quant import FP8_DTYPE, linear_ref, quantize_groups, quantize_groups_ref, quantize_weight  # noqa: E402,E501


INTERPRET_SCRIPT = r"""
import torch
from batchgen.kernels.fp8.gemm import GemmConfig, block_scaled_matmul, rowwise_scaled_mm, w8a8_matmul
from batchgen.kernels.fp8.quant import (linear_ref, quantize_groups, quantize_groups_ref, quantize_rows,
                                        quantize_weight)

torch.manual_seed(0)

import sys
sys.path.insert(0, "tests")
from fp8_checkpoints import exact_activations as exact_x

# (M, N, K, group_n, group_k): partial blocks in N and K, per-row block scales (group_n 1), per channel (None)
for m, n, k, gn, gk in [(5, 200, 320, 128, 128), (3, 96, 256, 1, 128), (17, 64, 96, 32, 32), (20, 40, 64, 1, None)]:
    x = exact_x(m, k, gk or 128)
    w, s = quantize_weight(torch.randn(n, k) * 0.05, gn if gk else None, gk)
    bias = torch.randn(n)
    ref = linear_ref(x, w, s, gn, gk, bias, act_group=gk or 128)
    # GROUP_M 2 over several M tiles: the grouped program order; BLOCK_M 32 > M 20 / 17: wrapped rows, masked stores
    for cfg in (GemmConfig(16, 32, 2, 4, 1), GemmConfig(32, 64, 1, 4, 1)):
        out = block_scaled_matmul(x, w, s, gn, gk, bias, config=cfg)
        err = (out - ref).abs().max().item()
        assert err < 1e-5 * ref.abs().max().item(), (m, n, k, gn, gk, cfg, err)
    q, qs = quantize_groups(x, gk or 128)  # column-major scales
    q_ref, qs_ref = quantize_groups_ref(x, gk or 128)
    assert qs.stride(0) == 1 and torch.equal(q.float(), q_ref.float()) and torch.equal(qs, qs_ref), (m, k, gk)
    out = w8a8_matmul(q, qs.contiguous(), w, s, gn, gk, torch.float32, None, GemmConfig(16, 32, 1, 4, 1))
    ref = linear_ref(x, w, s, gn, gk, None, act_group=gk or 128)
    assert (out - ref).abs().max().item() < 1e-5 * ref.abs().max().item(), (m, n, k, gn, gk)
x = exact_x(6, 256, 256).bfloat16()
q, scale = quantize_rows(x)
q_ref, scale_ref = quantize_groups_ref(x, 256)
assert torch.equal(q.float(), q_ref.float()) and torch.equal(scale, scale_ref)
w, s = quantize_weight(torch.randn(48, 256) * 0.05, None, None)
out = rowwise_scaled_mm(x, w, s.view(1, -1))  # torch._scaled_mm runs on CPU too
ref = linear_ref(x, w, s, 1, None, act_group=256)
assert (out.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max()
print("ok")
"""


@needs_interpreter
def test_fp8_gemm_kernels_match_reference_under_triton_interpreter():
    run_under_interpreter(INTERPRET_SCRIPT, timeout=600)


CUDA0 = torch.device("cuda", 0)  # gemm_path reads the device's type and index only: no GPU needed


@pytest.mark.parametrize("supported", [True, False])
def test_gemm_path_picks_cublas_blockwise_where_supported_and_triton_otherwise(monkeypatch, supported):
    from batchgen.kernels.fp8 import blockwise as fp8_blockwise

    probed = []
    monkeypatch.setattr(fp8_blockwise, "blockwise_scaled_mm_supported", lambda index: probed.append(index) or supported)
    bf16, fp16 = torch.bfloat16, torch.float16
    # 128x128 blocks, bf16, K / 128 a multiple of 4 (the 8B layer shapes): cuBLASLt where the probe says so
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        assert gemm_path(CUDA0, bf16, n, k, 128, 128, True) == ("blockwise" if supported else "triton")
    assert probed and set(probed) == {0}
    # what cuBLASLt's block-wise scaling does not take: the Triton GEMM, whatever the probe says
    assert gemm_path(CUDA0, bf16, 6144, 4096, 32, 32, True) == "triton"  # other block sizes
    assert gemm_path(CUDA0, bf16, 6144, 4096, 1, 128, True) == "triton"  # per-row blocks (fused parts off the grid)
    assert gemm_path(CUDA0, fp16, 6144, 4096, 128, 128, True) == "triton"
    assert gemm_path(CUDA0, bf16, 6144, 384, 128, 128, True) == "triton"  # K / 128 = 3
    # per channel: row-wise _scaled_mm in bf16 (K, N multiples of 16), else Triton
    assert gemm_path(CUDA0, bf16, 4096, 4096, 1, None, True) == "rowwise"
    assert gemm_path(CUDA0, fp16, 4096, 4096, 1, None, True) == "triton"
    assert gemm_path(CUDA0, bf16, 1000, 4096, 1, None, True) == "triton"
    # CPU and weight-only checkpoints: the dequantising reference, the probe not asked
    probed.clear()
    for group_n, group_k in ((128, 128), (1, None)):
        assert gemm_path(torch.device("cpu"), bf16, 6144, 4096, group_n, group_k, True) == "reference"
        assert gemm_path(CUDA0, bf16, 6144, 4096, group_n, group_k, False) == "reference"
    assert probed == []


@pytest.mark.parametrize("group_n,group_k", [(128, 128), (1, None)])
def test_fp8_linear_on_cpu_is_the_dequantising_reference_whatever_the_probe_says(monkeypatch, group_n, group_k):
    from batchgen.kernels.fp8 import blockwise as fp8_blockwise

    monkeypatch.setattr(fp8_blockwise, "blockwise_scaled_mm_supported", lambda index: pytest.fail("probed on CPU"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 512, generator=g)
    w, s = quantize_weight(torch.randn(256, 512, generator=g) * 0.02, group_n if group_k else None, group_k)
    bias = torch.randn(256, generator=g)
    out = fp8_linear(x, w, s, group_n, group_k, bias)
    assert out.shape == (3, 5, 256)
    assert torch.equal(out, linear_ref(x.reshape(15, 512), w, s, group_n, group_k, bias).reshape(3, 5, 256))


def test_engine_fp8_gemm_forces_a_block_scaled_path_and_leaves_the_others_alone(monkeypatch):
    from batchgen.kernels.fp8 import blockwise as fp8_blockwise
    from batchgen.kernels.fp8.gemm import forced_path

    monkeypatch.setattr(fp8_blockwise, "blockwise_scaled_mm_supported", lambda index: True)
    bf16, cpu = torch.bfloat16, torch.device("cpu")
    for path in ("triton", "splitk", "blockwise"):  # an 8B layer's block-scaled weight: that path at any M
        for auto in ("blockwise", "triton", "splitk"):
            assert forced_path(path, auto, CUDA0, bf16, 6144, 4096, 128, 128) == path
        for auto in ("reference", "rowwise"):  # CPU, weight-only, per channel: their own path
            assert forced_path(path, auto, CUDA0, bf16, 6144, 4096, 1, None) == auto
    assert forced_path("auto", "triton", CUDA0, bf16, 6144, 4096, 32, 32) == "triton"
    with pytest.raises(ValueError, match="engine.fp8_gemm: blockwise: .*scale blocks 32 x 32"):
        forced_path("blockwise", "triton", CUDA0, bf16, 6144, 4096, 32, 32)  # cuBLASLt takes 128x128 blocks only
    monkeypatch.setattr(fp8_blockwise, "blockwise_scaled_mm_supported", lambda index: False)
    monkeypatch.setattr(fp8_blockwise, "_BLOCKWISE_WHY_NOT", {0: "torch._scaled_mm raised RuntimeError: no"})
    with pytest.raises(ValueError, match=r"engine.fp8_gemm: blockwise: .*unavailable on this device and torch .*"
                                         r"\(torch._scaled_mm raised RuntimeError: no\); use auto"):
        forced_path("blockwise", "triton", CUDA0, bf16, 6144, 4096, 128, 128)  # a torch build without it
    with pytest.raises(ValueError, match="engine.fp8_gemm: blockwise: .*RuntimeError: no"):
        fp8_blockwise.refuse_unavailable("blockwise", 0)  # what the decoders' build calls: an error, not a fallback
    for path in ("auto", "triton", "splitk"):
        fp8_blockwise.refuse_unavailable(path, 0)
    with pytest.raises(ValueError, match="engine.fp8_gemm: 'fast' is not one of"):
        forced_path("fast", "triton", CUDA0, bf16, 6144, 4096, 128, 128)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 512, generator=g)
    w, s = quantize_weight(torch.randn(256, 512, generator=g) * 0.02, 128, 128)
    assert torch.equal(fp8_linear(x, w, s, 128, 128, path="splitk"), linear_ref(x, w, s, 128, 128))  # CPU: reference
    assert forced_path("splitk", "reference", cpu, bf16, 256, 512, 128, 128) == "reference"


def test_engine_fp8_gemm_reaches_the_fused_decoders_gemm_and_bad_values_are_refused_naming_the_key():
    import functools

    from pydantic import ValidationError

    from conftest import make_model

    from batchgen.engine.config import EngineConfig
    from batchgen.engine.engine import Engine
    from batchgen.quant.linear import linear

    model = make_model("llama")
    decoder = Engine(model, None, EngineConfig(num_kv_blocks=8, fp8_gemm="splitk")).runner.decode_forward
    assert isinstance(decoder.linear, functools.partial) and decoder.linear.func is linear
    assert decoder.linear.keywords == {"fp8_path": "splitk"}
    assert Engine(model, None, EngineConfig(num_kv_blocks=8)).runner.decode_forward.linear is linear
    with pytest.raises(ValidationError, match="fp8_gemm"):
        EngineConfig(fp8_gemm="fast")


def test_triton_launch_configs_tuned_per_shape_only_where_the_sweep_measured_them():
    from batchgen.kernels.fp8.gemm import CONFIGS, GemmConfig, gemm_config

    assert gemm_config(32, 6144, 4096, 132) == GemmConfig(16, 32, 8, 4, 4)  # qkv
    assert gemm_config(1, 6144, 4096, 132) == GemmConfig(16, 32, 8, 4, 4)
    assert gemm_config(32, 28672, 4096, 132) == GemmConfig(32, 64, 8, 4, 4)  # gate_up
    # above the tuned buckets and other shapes: the per-M defaults (the sweep found them best at M 256)
    assert gemm_config(256, 6144, 4096, 132) == CONFIGS[256]
    assert gemm_config(256, 28672, 4096, 132) == CONFIGS[256]
    assert gemm_config(64, 6144, 4096, 132) == CONFIGS[64]
    assert gemm_config(32, 4096, 4096) == CONFIGS[32]


# GPU tests below: few distinct launch configs and shapes, as each is one Triton compile on a cold GPU. Every config
# the tables hold ran on the GPU in bench/fp8_gemm.py --sweep, which checks its error before timing it.
def _case(m: int, n: int, k: int, group_n: int | None, group_k: int | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to("cuda", torch.bfloat16)
    w, s = quantize_weight(torch.randn(n, k, generator=g).mul(0.02).cuda(), group_n, group_k)
    return x, w, s


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (256, 1000, 896)])  # the tuned qkv config; a default one over
def test_block_scaled_gemm_equals_the_emulated_w8a8_reference_bf16_on_gpu(m, n, k):  # partial N and K tiles
    x, w, s = _case(m, n, k, 128, 128)
    out = block_scaled_matmul(x, w, s, 128, 128)
    assert _rel_err(out, linear_ref(x, w, s, 128, 128, act_group=128)) < 1e-2  # bf16 output rounding
    assert _rel_err(out, linear_ref(x, w, s, 128, 128)) < 6e-2  # activation quantisation's own error


@pytest.mark.gpu
def test_group_quantiser_on_gpu():
    x, _, _ = _case(200, 128, 4096, 128, 128)
    q, qs = quantize_groups(x, 128)
    q_ref, qs_ref = quantize_groups_ref(x, 128)
    assert qs.stride() == (1, 200) and torch.allclose(qs, qs_ref, rtol=1e-6, atol=0)
    assert (q.float() - q_ref.float()).abs().max() <= 32  # equal up to one fp8 ulp (32 in the top binade)


def test_blockwise_probe_says_why_not(monkeypatch):
    """The probe's answer carries its reason (bench reports and engine.fp8_gemm's refusal print it): off sm90, the
    error torch._scaled_mm raised (its type and first line), or a wrong result."""
    from batchgen.kernels.fp8 import blockwise as fp8_blockwise

    monkeypatch.setattr(fp8_blockwise, "_BLOCKWISE_SUPPORTED", {})
    monkeypatch.setattr(fp8_blockwise, "_BLOCKWISE_WHY_NOT", {})
    if not torch.cuda.is_available():
        assert fp8_blockwise.blockwise_unsupported_reason(0) == "not an sm90 GPU"
        assert fp8_blockwise._BLOCKWISE_SUPPORTED == {0: False}

    def raises(*args, **kwargs):
        raise RuntimeError("Invalid scaling configuration\nmore detail")

    monkeypatch.setattr(torch, "_scaled_mm", raises)
    cpu = torch.device("cpu")
    assert fp8_blockwise._probe_blockwise(cpu) == "torch._scaled_mm raised RuntimeError: Invalid scaling configuration"
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: torch.zeros(a.shape[0], b.shape[1]))
    assert fp8_blockwise._probe_blockwise(cpu).startswith("wrong result at M = 1: relative error 1 ")


def test_blockwise_mm_pads_the_rows_to_a_multiple_of_4_for_cublaslt_and_drops_the_padding(monkeypatch):
    """cuBLASLt's 1x128 block-wise kernels need M % 4 == 0, unchecked by torch: _blockwise_mm pads the fp8 rows
    (zeros) and their column-major scales (ones) and slices the output back. A stand-in for torch._scaled_mm that
    insists on the layout cuBLASLt takes computes the scaled product in fp32."""
    from batchgen.kernels.fp8 import blockwise as fp8_blockwise

    seen = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        m, k = a.shape
        assert m % 4 == 0 and scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)
        seen.append(m)
        a_scale = scale_a.repeat_interleave(128, 1)
        b_scale = scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :b.shape[1]]
        return ((a.float() * a_scale) @ (b.float() * b_scale)).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    g = torch.Generator().manual_seed(0)
    w, s = quantize_weight(torch.randn(256, 512, generator=g) * 0.02, 128, 128)
    for m in (1, 3, 4, 5, 16):
        x = torch.randn(m, 512, generator=g).to(torch.bfloat16)
        xq, xs = quantize_groups_ref(x, 128)
        out = fp8_blockwise._blockwise_mm(xq, xs.t().contiguous().t(), w, s, torch.bfloat16)
        assert out.shape == (m, 256), m
        assert _rel_err(out, linear_ref(x, w, s, 128, 128, act_group=128)) < 1e-2, m
    assert seen == [4, 4, 4, 8, 16]


@pytest.mark.gpu
def test_cublas_blockwise_scaled_mm_equals_the_reference_and_is_the_default_above_splitk_rows():
    from batchgen.kernels.fp8.blockwise import blockwise_unsupported_reason
    from batchgen.kernels.fp8.gemm import SPLITK_MAX_ROWS, SPLITK_SHAPE_ROWS

    if not blockwise_scaled_mm_supported(0):
        pytest.skip(f"torch._scaled_mm's 1x128 x 128x128 block-wise scaling is off here: "
                    f"{blockwise_unsupported_reason(0)}")
    for m in (1, 3, SPLITK_MAX_ROWS + 1, 256):
        x, w, s = _case(m, 6144, 4096, 128, 128)
        out = blockwise_scaled_mm(x, w, s)
        assert _rel_err(out, linear_ref(x, w, s, 128, 128, act_group=128)) < 1e-2, m
        chosen = gemm_path(x.device, x.dtype, 6144, 4096, 128, 128, True, m)
        splitk_rows = max(SPLITK_MAX_ROWS, SPLITK_SHAPE_ROWS.get((6144, 4096), 0))  # a measured shape goes further
        assert chosen == ("splitk" if m <= splitk_rows else "blockwise"), (m, chosen)
        if chosen == "blockwise":  # the entry point runs the same cuBLASLt call
            assert torch.equal(fp8_linear(x, w, s, 128, 128), out), m


@pytest.mark.gpu
def test_blockwise_probe_refuses_to_run_inside_a_graph_capture(monkeypatch):
    from batchgen.kernels.fp8 import blockwise as fp8_blockwise

    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the probe runs on sm90 only (elsewhere: no, without a GEMM)")
    monkeypatch.setattr(fp8_blockwise, "_BLOCKWISE_SUPPORTED", {})  # not probed yet on this device
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture"):
        with torch.cuda.graph(graph):
            fp8_blockwise.blockwise_scaled_mm_supported(0)
    assert fp8_blockwise._BLOCKWISE_SUPPORTED == {}


@pytest.mark.gpu
def test_per_channel_paths_equal_the_emulated_reference_bf16_on_gpu():
    for m in (1, 256):
        x, w, s = _case(m, 4096, 4096, None, None)
        scaled_mm = rowwise_scaled_mm(x, w, s.view(1, -1))  # per token
        assert _rel_err(scaled_mm, linear_ref(x, w, s, 1, None, act_group=4096)) < 1e-2
        assert torch.equal(fp8_linear(x, w, s, 1, None), scaled_mm)  # the entry point's choice for bf16
    triton_out = block_scaled_matmul(x[:32], w, s, 1, None)  # per token and group of 128 (fp16/fp32 activations)
    assert _rel_err(triton_out, linear_ref(x[:32], w, s, 1, None, act_group=128)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["default", "triton", "channel"])
def test_fp8_linear_replays_from_a_cuda_graph(monkeypatch, path):
    from batchgen.kernels.fp8 import blockwise as fp8_blockwise

    if path == "triton":  # the block path where cuBLASLt has no block-wise scaling
        monkeypatch.setattr(fp8_blockwise, "blockwise_scaled_mm_supported", lambda index: False)
    group_n, group_k = (1, None) if path == "channel" else (128, 128)
    x, w, s = _case(32, 2048, 1024, None if path == "channel" else 128, group_k)
    bias = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    static_x = x.clone()
    fp8_linear(static_x, w, s, group_n, group_k, bias)  # compile and probe outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fp8_linear(static_x, w, s, group_n, group_k, bias)
    static_x.copy_(x * 3)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, fp8_linear(x * 3, w, s, group_n, group_k, bias))
    assert w.dtype == FP8_DTYPE


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,fp8_gemm", [("block", "auto"), ("block128", "auto"), ("channel", "auto"),
                                          ("block128", "triton"), ("block128", "splitk"), ("block", "splitk")])
def test_fp8_engine_with_cuda_graphs_and_async_equals_eager_sync_bf16_on_gpu(tmp_path, fmt, fp8_gemm):
    """32x32 blocks: the Triton GEMM; 128x128 blocks (hidden 512, MLP 1024): cuBLASLt's block-wise _scaled_mm
    where supported; per channel: row-wise _scaled_mm; engine.fp8_gemm forcing a block-scaled path. max_num_seqs
    8: four graph buckets, few Triton compiles."""
    from batchgen.kernels.fp8.gemm import forced_path

    from conftest import make_model, make_tokenizer, random_prompts
    from fp8_checkpoints import save_fp8_checkpoint

    from batchgen.engine.config import EngineConfig
    from batchgen.engine.engine import Engine
    from batchgen.runner.loader import load_model
    from batchgen.sampling_params import SamplingParams

    tok = make_tokenizer()
    dims = dict(hidden_size=512, intermediate_size=1024) if fmt == "block128" else {}
    folder = save_fp8_checkpoint(make_model("llama", vocab_size=len(tok), **dims), tok, tmp_path / fmt, fmt)
    model = load_model(str(folder), "bfloat16", "cuda")
    assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
    prompts = random_prompts([5, 9, 13, 17, 40], vocab_size=len(tok), seed=3)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = []
    for graphs, async_pipeline in ((False, False), (True, True)):
        engine = Engine(model, tok, EngineConfig(cuda_graphs=graphs, async_pipeline=async_pipeline, max_num_seqs=8,
                                                 fp8_gemm=fp8_gemm))
        assert engine.decode_path == "fused"
        qkv = engine.runner.decode_forward.layers[0].qkv_weight
        want = {"block": "triton", "channel": "rowwise",
                "block128": "blockwise" if blockwise_scaled_mm_supported(0) else "triton"}[fmt]
        auto = gemm_path(CUDA0, torch.bfloat16, *qkv.shape, qkv.group_n, qkv.group_k, qkv.act_quant)
        assert auto == want
        assert forced_path(fp8_gemm, auto, CUDA0, torch.bfloat16, *qkv.shape, qkv.group_n, qkv.group_k) == \
            (want if fp8_gemm == "auto" else fp8_gemm)
        outs.append([r.samples[0].token_ids for r in engine.generate(prompts, params)])
        engine.close()
    assert outs[0] == outs[1]


def test_the_start_up_description_of_the_fp8_gemms_names_each_path_and_the_probes_reason(monkeypatch):
    from batchgen.kernels.fp8 import blockwise as fp8_blockwise
    from batchgen.kernels.fp8 import gemm as fp8_gemm
    from batchgen.kernels.fp8.gemm import describe_paths

    bf16 = torch.bfloat16
    assert describe_paths(torch.device("cpu"), bf16, 128, 128, True) == "FP8 weights dequantised (CPU reference)"
    monkeypatch.setattr(fp8_blockwise, "blockwise_scaled_mm_supported", lambda index: True)
    monkeypatch.setattr(fp8_gemm, "SPLITK_SHAPE_ROWS", {(4096, 14336): 64, (4096, 4096): 32})  # 32: no further
    assert describe_paths(CUDA0, bf16, 128, 128, True) == \
        "FP8 GEMMs: split-K at <= 32 rows, 4096x14336 to 64, cuBLASLt block-wise above"
    monkeypatch.setattr(fp8_gemm, "SPLITK_SHAPE_ROWS", {})
    assert describe_paths(CUDA0, bf16, 128, 128, True) == "FP8 GEMMs: split-K at <= 32 rows, cuBLASLt block-wise above"
    assert describe_paths(CUDA0, bf16, 1, None, True) == "FP8 GEMMs: row-wise _scaled_mm"
    assert describe_paths(CUDA0, bf16, 128, 128, False) == "FP8 weights dequantised (a weight-only checkpoint)"
    assert describe_paths(CUDA0, bf16, 128, 128, True, "triton") == \
        "FP8 GEMMs: triton (engine.fp8_gemm) at every batch size"
    monkeypatch.setattr(fp8_blockwise, "blockwise_scaled_mm_supported", lambda index: False)
    monkeypatch.setattr(fp8_blockwise, "_BLOCKWISE_WHY_NOT", {0: "torch._scaled_mm raised RuntimeError: no"})
    assert describe_paths(CUDA0, bf16, 128, 128, True) == ("FP8 GEMMs: split-K at <= 32 rows, Triton above (block-wise "
                                                          "_scaled_mm off: torch._scaled_mm raised RuntimeError: no)")

"""The FP8 GEMM kernels against their torch references: under TRITON_INTERPRET=1 on CPU, on a GPU in bf16 (random
activations, CUDA-graph capture, the engine end to end).

The interpreter (Triton 3.6) rounds float32 -> float8e4nv wrongly where the rounding carries into the exponent
(124.3 becomes 64, not 128), so its check uses activations whose quantisation is exact (each token group: fp8
grid values with absolute max 448, times a power of two): any error of indexing, scales or accumulation still
shows; the rounding itself is covered on the GPU. Triton 3.6's interpreter also needs numpy < 2.4 (with 2.4+ it
fails in its own code: "only 0-dimensional arrays can be converted to Python scalars"): the test is skipped there."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy
import pytest
import torch

pytest.importorskip("triton")

from batchgen.kernels.fp8_gemm import (  # noqa: E402
    block_scaled_matmul, blockwise_scaled_mm, blockwise_scaled_mm_supported, fp8_linear, rowwise_scaled_mm,
    w8a8_matmul)
from batchgen.kernels.fp8_quant import FP8_DTYPE, linear_ref, quantize_groups, quantize_groups_ref, quantize_weight  # noqa: E402,E501

NUMPY_TOO_NEW = tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4)

INTERPRET_SCRIPT = r"""
import torch
from batchgen.kernels.fp8_gemm import GemmConfig, block_scaled_matmul, rowwise_scaled_mm, w8a8_matmul
from batchgen.kernels.fp8_quant import (FP8_DTYPE, linear_ref, quantize_groups, quantize_groups_ref, quantize_rows,
                                        quantize_weight)

torch.manual_seed(0)

def exact_x(m, k, group):
    q = torch.randn(m, k).mul(100).clamp(-440, 440).to(FP8_DTYPE).float()
    groups = -(-k // group)
    q[:, ::group] = 448.0
    return q * (2.0 ** torch.randint(-12, -4, (m, groups)).float()).repeat_interleave(group, 1)[:, :k]

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


@pytest.mark.skipif(NUMPY_TOO_NEW, reason=f"numpy {numpy.__version__} >= 2.4: Triton 3.6's interpreter needs numpy < 2.4 "
                    "(InterpreterError: only 0-dimensional arrays can be converted to Python scalars)")
def test_fp8_gemm_kernels_match_reference_under_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when triton is imported: a fresh interpreter
    result = subprocess.run([sys.executable, "-c", INTERPRET_SCRIPT], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def _case(m: int, n: int, k: int, group_n: int | None, group_k: int | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to("cuda", torch.bfloat16)
    w, s = quantize_weight(torch.randn(n, k, generator=g).mul(0.02).cuda(), group_n, group_k)
    return x, w, s


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 32, 256, 512])
@pytest.mark.parametrize("n,k", [(6144, 4096), (1000, 896)])
def test_block_scaled_gemm_equals_the_emulated_w8a8_reference_bf16_on_gpu(m, n, k):
    x, w, s = _case(m, n, k, 128, 128)
    out = block_scaled_matmul(x, w, s, 128, 128)
    assert _rel_err(out, linear_ref(x, w, s, 128, 128, act_group=128)) < 1e-2  # bf16 output rounding
    assert _rel_err(out, linear_ref(x, w, s, 128, 128)) < 6e-2  # activation quantisation's own error


@pytest.mark.gpu
def test_group_quantiser_and_every_default_config_on_gpu():
    from batchgen.kernels.fp8_gemm import CONFIGS
    x, w, s = _case(200, 1024, 4096, 128, 128)
    q, qs = quantize_groups(x, 128)
    q_ref, qs_ref = quantize_groups_ref(x, 128)
    assert qs.stride() == (1, 200) and torch.allclose(qs, qs_ref, rtol=1e-6, atol=0)
    assert (q.float() - q_ref.float()).abs().max() <= 32  # equal up to one fp8 ulp (32 in the top binade)
    ref = linear_ref(x, w, s, 128, 128, act_group=128)
    for cfg in CONFIGS.values():
        assert _rel_err(w8a8_matmul(q, qs, w, s, 128, 128, torch.bfloat16, config=cfg), ref) < 1e-2, cfg


@pytest.mark.gpu
def test_cublas_blockwise_scaled_mm_equals_the_reference_where_supported():
    if not blockwise_scaled_mm_supported(0):
        pytest.skip("torch._scaled_mm has no 1x128 x 128x128 block-wise scaling here (needs sm90, cuBLASLt >= 12.9)")
    for m in (1, 32, 256):
        x, w, s = _case(m, 6144, 4096, 128, 128)
        assert _rel_err(blockwise_scaled_mm(x, w, s), linear_ref(x, w, s, 128, 128, act_group=128)) < 1e-2, m


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 32, 256])
def test_per_channel_paths_equal_the_emulated_reference_bf16_on_gpu(m):
    x, w, s = _case(m, 4096, 4096, None, None)
    scaled_mm = rowwise_scaled_mm(x, w, s.view(1, -1))  # per token
    assert _rel_err(scaled_mm, linear_ref(x, w, s, 1, None, act_group=4096)) < 1e-2
    triton_out = block_scaled_matmul(x, w, s, 1, None)  # per token and group of 128
    assert _rel_err(triton_out, linear_ref(x, w, s, 1, None, act_group=128)) < 1e-2
    assert torch.equal(fp8_linear(x, w, s, 1, None), scaled_mm)  # the entry point's choice for bf16


@pytest.mark.gpu
@pytest.mark.parametrize("group_k", [128, None])
def test_fp8_linear_replays_from_a_cuda_graph(group_k):
    x, w, s = _case(32, 2048, 1024, 128 if group_k else None, group_k)
    bias = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    static_x = x.clone()
    fp8_linear(static_x, w, s, 128 if group_k else 1, group_k, bias)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fp8_linear(static_x, w, s, 128 if group_k else 1, group_k, bias)
    static_x.copy_(x * 3)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, fp8_linear(x * 3, w, s, 128 if group_k else 1, group_k, bias))
    assert w.dtype == FP8_DTYPE


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_fp8_engine_with_cuda_graphs_and_async_equals_eager_sync_bf16_on_gpu(tmp_path, fmt):
    from conftest import make_model, make_tokenizer, random_prompts
    from fp8_checkpoints import save_fp8_checkpoint

    from batchgen.engine.config import EngineConfig
    from batchgen.engine.engine import Engine
    from batchgen.runner.loader import load_model
    from batchgen.sampling_params import SamplingParams

    tok = make_tokenizer()
    folder = save_fp8_checkpoint(make_model("llama", vocab_size=len(tok)), tok, tmp_path / fmt, fmt)
    model = load_model(str(folder), "bfloat16", "cuda")
    assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
    prompts = random_prompts([5, 9, 13, 17, 40], vocab_size=len(tok), seed=3)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = []
    for graphs, async_pipeline in ((False, False), (True, True)):
        engine = Engine(model, tok, EngineConfig(cuda_graphs=graphs, async_pipeline=async_pipeline))
        assert engine.decode_path == "fused"
        outs.append([r.samples[0].token_ids for r in engine.generate(prompts, params)])
        engine.close()
    assert outs[0] == outs[1]

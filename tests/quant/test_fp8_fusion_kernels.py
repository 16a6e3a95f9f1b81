"""The FP8 hand-offs' kernels (quant/fusion.py): the RMSNorm and the gated activation quantising the next
GEMM's input themselves, and the residual add + RMSNorm summing the previous split-K GEMM's partials, bit for bit as
the unfused kernels (quantize_groups, the split-K reduction) compute them, and each GEMM path reading the quantised
input as its own quantiser's output: under the Triton interpreter (every launch also compiled for sm_90), the
fused norm's row sum in the unfused kernel's sm_90 layout, and on a GPU at Llama-8B shapes. Whole decode steps:
tests/quant/test_fp8_fusion_steps.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import needs_interpreter, run_under_interpreter  # noqa: E402



KERNELS_SCRIPT = r"""
import sys
import torch
sys.path.insert(0, "tests")
from fp8_fusion_cases import check_attention, check_gated, check_gemm_reads_quantized, check_norm
from batchgen.kernels.fp8 import gemm as fp8_gemm

# row widths: partial last group (200 / 32), whole groups, narrower than a group (64 < 128: one group); a cap that
from batchgen.kernels.fp8 import splitk_common
# binds (2.0 against normal * 3 rows); every RMS rounding; residual or not; Granite's x_scale; 2-3 splits, a bias
for dtype in (torch.float32, torch.bfloat16):
    for cols, group, ub in [(200, 32, None), (256, 128, 2.0), (64, 128, None)]:
        for kind in ("rms", "rms_unit_offset", "rms_fp32_weight"):
            check_norm("cpu", dtype, 5, cols, group, ub, kind, residual=True, x_scale=None, splits=0, bias=False)
        check_norm("cpu", dtype, 5, cols, group, ub, "rms", residual=False, x_scale=None, splits=0, bias=False)
        check_norm("cpu", dtype, 5, cols, group, ub, "rms", residual=True, x_scale=0.5, splits=3, bias=True)
        check_norm("cpu", dtype, 5, cols, group, ub, "rms_unit_offset", residual=False, x_scale=None, splits=2,
                   bias=False)
        for activation in ("silu", "gelu_tanh"):
            check_gated("cpu", dtype, 5, cols, group, ub, activation)
    check_gated("cpu", dtype, 3, 2100, 2048, None, "silu")  # a group wider than the kernel's 1024 columns
    # the decode attention: QKV partials (3 splits, a bias; or the tensor), its output quantised: one head a group,
    # two groups a head, a capped scale; one context split (the kernel quantises) and two (the merge kernel does);
    # Qwen3's q/k norm; heads that are not whole groups (a tensor back); MHA
    for qkv_splits, bias, group, ub, attn_splits in [(3, True, 32, None, 1), (3, False, 16, 2.0, 2),
                                                     (0, False, 32, None, 2), (2, True, None, None, 1)]:
        check_attention("cpu", dtype, 4, 4, 2, 32, group, ub, qkv_splits, bias, attn_splits)
    for attn_splits in (1, 2):  # Qwen3's q/k norm: the one-split kernel quantises beside the norm's row sums
        check_attention("cpu", dtype, 3, 4, 2, 32, 32, None, 2, False, attn_splits, qk_norm=True)
    check_attention("cpu", dtype, 3, 4, 2, 24, 8, None, 2, True, 1)  # 24 dims (padded to 32): not quantised
    check_attention("cpu", dtype, 3, 4, 4, 32, 32, None, 2, True, 2)  # MHA

def scaled_mm(a, b, scale_a, scale_b, out_dtype):  # cuBLASLt's block-wise _scaled_mm, in fp32, its layout checked
    m, k = a.shape
    assert m % 4 == 0 and scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)
    b_scale = scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :b.shape[1]]
    return ((a.float() * scale_a.repeat_interleave(128, 1)) @ (b.float() * b_scale)).to(out_dtype)

torch._scaled_mm = scaled_mm
splitk_common.MIN_BLOCKS_PER_SPLIT = 1  # split-K over 5 blocks: 5 splits, the partials summed
for path, k, group in (("splitk", 320, 64), ("triton", 320, 64), ("blockwise", 512, 128)):
    fp8_gemm.gemm_path = lambda *args, path=path, **kwargs: path
    check_gemm_reads_quantized("cpu", torch.bfloat16, 5, 96, k, group, path)
print("ok")
"""


@needs_interpreter
def test_fused_norm_and_gated_activation_quantise_and_sum_bit_identically_to_the_unfused_kernels_under_interpreter():
    run_under_interpreter(KERNELS_SCRIPT, timeout=600)


SUM_LAYOUT_SCRIPT = r"""
import re
import torch
from batchgen.kernels.norm import rmsnorm as norm_kernels
from batchgen.kernels.fp8.quant import ActQuant
from batchgen.kernels.fp8.splitk_common import SplitKPartials

builds = norm_kernels._rmsnorm_kernel.device_caches[0][0]  # the sm_90 builds of this process, by specialisation
g = torch.Generator().manual_seed(0)
for cols in (2048, 4096, 5120):  # 4 and 16 warps; a row wider than a power of two
    builds.clear()
    x, w = torch.randn(2, cols, generator=g).bfloat16(), torch.ones(cols).bfloat16()
    part = SplitKPartials(torch.randn(3, 2, cols, generator=g), None, torch.bfloat16)
    norm_kernels.rmsnorm(x, w, 1e-5, residual=x.clone())
    norm_kernels.rmsnorm(x, w, 1e-5, residual=x.clone(), quant=ActQuant(128))
    norm_kernels.rmsnorm(part, w, 1e-5, residual=x.clone(), quant=ActQuant(128))
    layouts = []
    for build in builds.values():
        ir = build.asm["ttgir"]
        aliases = dict(re.findall(r"^(#\w+) = (#ttg\.[^\n]*)$", ir, re.M))
        row_sum = re.search(r'"tt\.reduce"\(%rstd[^)]*\).*?\}\) : \(tensor<\d+xf32, (#\w+)>\)', ir, re.S)
        layouts.append(aliases[row_sum.group(1)])
    assert len(layouts) == 3 and len(set(layouts)) == 1, (cols, layouts)
print("ok")
"""


def test_the_fused_norm_sums_its_row_in_the_unfused_kernels_layout_when_compiled_for_sm90():
    """The GPU half of the bit-identity claim without a GPU: the row's sum of squares is the one fp32 reduction
    before the rounding, and Triton lowers a reduction by its operand's layout (elements a thread, threads, warps:
    the order of the additions). The quantising variants (after the norm, and over split-K partials) reduce in
    exactly the plain kernel's layout: the quantisation after the row adds no layout that reaches back to it."""
    run_under_interpreter(SUM_LAYOUT_SCRIPT, timeout=300)


# GPU twins: the kernels at Llama-8B shapes (hidden 4096, MLP 14336, 128-column groups), bf16
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32, 256])
def test_fused_norm_and_gated_activation_are_bit_identical_to_the_unfused_kernels_on_gpu_at_8b_shapes(rows):
    from fp8_fusion_cases import check_attention, check_gated, check_norm

    bf16 = torch.bfloat16
    for kind in ("rms", "rms_unit_offset", "rms_fp32_weight"):
        check_norm("cuda", bf16, rows, 4096, 128, None, kind, residual=True, x_scale=None, splits=0, bias=False)
    check_norm("cuda", torch.float16, rows, 4096, 128, 2.0, "rms", residual=True, x_scale=None, splits=0, bias=False)
    # o's 4 splits with a bias and Granite's scale; 7 splits (an odd count); Gemma2's post-attention norm (no
    # residual)
    check_norm("cuda", bf16, rows, 4096, 128, 2.0, "rms", residual=True, x_scale=0.5, splits=4, bias=True)
    check_norm("cuda", bf16, rows, 4096, 128, None, "rms", residual=True, x_scale=None, splits=7, bias=False)
    check_norm("cuda", bf16, rows, 4096, 128, None, "rms_unit_offset", residual=False, x_scale=None, splits=4,
               bias=False)
    for activation in ("silu", "gelu_tanh"):
        check_gated("cuda", bf16, rows, 14336, 128, None, activation)
    check_gated("cuda", bf16, rows, 14336, 128, 2.0, "silu")
    # the decode attention at Llama-8B heads (32 x 128, 8 KV heads): qkv's 4 splits, o's 128-column groups;
    # one context split and four (the merge kernel quantises); Qwen2's QKV bias; Qwen3's q/k norm
    if rows <= 32:
        check_attention("cuda", bf16, rows, 32, 8, 128, 128, None, 4, False, 1)
        check_attention("cuda", bf16, rows, 32, 8, 128, 128, None, 4, True, 4)
        for attn_splits in (1, 2):  # with one split the kernel quantises beside the norm's row sums
            check_attention("cuda", bf16, rows, 32, 8, 128, 128, 2.0, 4, False, attn_splits, qk_norm=True)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["splitk", "triton", "blockwise"])
def test_each_gemm_path_reads_the_fused_quantised_input_as_its_quantisers_output_on_gpu(monkeypatch, path):
    from fp8_fusion_cases import check_gemm_reads_quantized

    from batchgen.kernels.fp8 import blockwise as fp8_blockwise

    from batchgen.kernels.fp8 import gemm as fp8_gemm

    if path == "blockwise" and not fp8_blockwise.blockwise_scaled_mm_supported(0):
        pytest.skip(f"no block-wise _scaled_mm here: {fp8_blockwise.blockwise_unsupported_reason(0)}")
    monkeypatch.setattr(fp8_gemm, "gemm_path", lambda *args, **kwargs: path)
    check_gemm_reads_quantized("cuda", torch.bfloat16, 32, 4096, 4096, 128, path)  # o's shape: 4 splits

"""Split-K FP8 GEMM for decode-sized M: out [M, N] = xq [M, K] @ dequant(weight [N, K])^T (+ bias), the
activations already quantised per token and group (fp8_quant.quantize_groups), as fp8_gemm.w8a8_matmul computes.

Why: at M <= 64 a GEMM is a stream of the weight. w8a8_matmul runs one program per column tile, each over all
of K: for o / down / qkv that is <= 128-192 programs on 132 SMs, too few loads in flight to reach HBM bandwidth
(1.0-1.4 TB/s measured of the H200's ~4.3). Here program (row tile, column tile, split) takes only the k blocks
[split * per_split, (split + 1) * per_split) -- whole scale blocks of BLOCK_K = group_k columns, so every block's
fp8 x fp8 -> fp32 dot is scaled once by a_scale[m, kb] * w_scale[n // group_n, kb] exactly as in w8a8_matmul --
and SPLITS is chosen per (N, K) so that the grid holds >= 2 programs per SM, each deeply pipelined (num_stages).

Epilogue, deterministic: with SPLITS > 1 each program writes its fp32 partial to a workspace [SPLITS, M, N]
(torch.empty, its shape follows M: no memset, no host sync, CUDA-graph capturable), then a second small kernel
sums the partials in split order 0, 1, ... in fp32, adds the bias in fp32 and rounds once to the output dtype
(as linear_ref rounds its fp32 result once); or, `unreduced`, the kernel that reads the output next does that
sum (splitk_common.SplitKPartials: the fused decoders' residual add + RMSNorm after the o and down projections).
No atomics: the result does not depend on program order, and the bf16 output equals the fp32 output rounded.
With SPLITS 1 the GEMM kernel does that epilogue itself (one launch).

fp8_gemm's default path for block-scaled weights at M <= fp8_gemm.SPLITK_MAX_ROWS (32: the rows at which a GPU run
measured it faster end to end), and up to fp8_gemm.SPLITK_SHAPE_ROWS's rows for the weight shapes listed there;
bench/fp8_gemm.py times it (column `splitk`, at every M) and sweeps its configs (row tiles of 64 or 128 above 64).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from batchgen.kernels.fp8.quant import CHANNEL_ACT_GROUP, gemm_operands, quantize_groups
# the split rule, tile epilogue and reduce (splitk_common.py); num_sms and split_sizes re-exported (fp8_gemm and the
# benches import them here)
from batchgen.kernels.fp8.splitk_common import (SplitKPartials, block_m_for, device_has_tma, device_sms, num_sms,
                                           split_count, split_sizes, store_tile)

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None
if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor  # Triton 3.6 (pinned) has it: no silent fallback

__all__ = ["SplitKConfig", "num_sms", "split_sizes", "splitk_config", "splitk_matmul", "splitk_scaled_matmul"]


class SplitKConfig(NamedTuple):
    block_n: int
    splits: int  # requested K splits; the launch uses ceil(blocks / ceil(blocks / splits)): none empty
    warps: int
    stages: int
    # weight tiles through a TMA descriptor (Hopper's bulk tensor copies; zero-filled past N and K) instead of one
    # pointer per element; ignored on GPUs without TMA (splitk_common.has_tma)
    tma: bool = False
    # rows a program's tile holds (a power of two, >= 16); 0: M's power of two up to splitk_common.MAX_BLOCK_M (64)
    block_m: int = 0


def splitk_config(m: int, n: int, k: int, block_k: int = 128, sms: int = 132) -> SplitKConfig:
    """Default launch config: 64-column tiles; splits: splitk_common.split_count (>= 2 programs per SM, dividing
    K's scale blocks evenly where that costs at most twice as many, the count spreading the programs most evenly
    over the SMs; 1 where the column tiles alone do: gate_up; never under 8 blocks a split); with one split,
    128-column tiles where there are still as many as SMs (gate_up at M 32 / 64, the 2026-12-02 sweep: 39.0 vs
    40.5 us, 39.4 vs 49.7); 4 warps, 4 stages (an H200 sweep of 2026-12-02,
    bench/fp8_gemm.py --sweep: 4 stages at least as fast as 5 or 6 at every Llama-8B shape, M 16-64); weight
    tiles by TMA (a 2026-12-02 sweep at M = 32, these tiles: qkv 13.6 vs 14.4 us, o 11.0 vs 12.1, down 26.2 vs
    27.0; gate_up 40.1 vs 39.8, a tie)."""
    block_n = 64
    splits = split_count(m, n, -(-k // block_k), block_n, sms)
    if splits == 1 and -(-n // 128) >= sms:
        block_n = 128  # the column tiles alone fill the SMs: wider ones, still one a SM at least (gate_up)
    return SplitKConfig(block_n, splits, 4, 4, True)


if triton is not None:
    @triton.jit
    def scaled_block_tile(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, pid_m, pid_n, kb_first, kb_end, M, N, K,
                          stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cm, group_n,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, B_TMA: tl.constexpr = False):
        """Output tile (pid_m, pid_n) of the k blocks [kb_first, kb_end): the sum over them of
        (A_fp8 @ B_fp8^T)[block] * a_scale[m, kb] * b_scale[n // group_n, kb] in fp32 (+ bias), stored in c's
        dtype at c_ptr. Rows / columns past the edge wrap (unmasked loads in bounds) and are not stored. Shared by
        the split-K kernel (one k range a program) and fp8_gemm's whole-K kernel. B_TMA: b_ptr is a TMA
        descriptor of the weight [N, K] with [BLOCK_N, BLOCK_K] tiles (zeros past N and K), not a pointer."""
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = kb_first * BLOCK_K + tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        if not B_TMA:
            b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        as_ptrs = as_ptr + offs_m * stride_asm
        bs_ptrs = bs_ptr + (offs_n // group_n) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(kb_first, kb_end):
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=tl.arange(0, BLOCK_K)[None, :] < k_left, other=0.0)
            if B_TMA:
                b = tl.trans(b_ptr.load([pid_n * BLOCK_N, kb * BLOCK_K]))  # [BLOCK_K, BLOCK_N]
            else:
                b = tl.load(b_ptrs, mask=tl.arange(0, BLOCK_K)[:, None] < k_left, other=0.0)
                b_ptrs += BLOCK_K
            a_s = tl.load(as_ptrs + kb * stride_ask)
            b_s = tl.load(bs_ptrs + kb * stride_bsk)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K
        store_tile(acc, bias_ptr, c_ptr, pid_m, pid_n, M, N, stride_cm, HAS_BIAS, BLOCK_M, BLOCK_N)

    @triton.jit
    def _splitk_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, per_split, stride_am, stride_asm,
                       stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cs, stride_cm, group_n,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       B_TMA: tl.constexpr):
        """Program (row tile, column tile, split): the sum over its k blocks kb of
        (A_fp8 @ B_fp8^T)[block] * a_scale[m, kb] * b_scale[n // group_n, kb], stored (+ bias, in c's dtype) at
        c + split * stride_cs. Rows / columns past the edge wrap (unmasked loads in bounds), not stored. B_TMA:
        b_ptr is the weight's TMA descriptor (scaled_block_tile). The row tile is the grid's fastest axis: the
        row tiles of one weight tile start together, so above one row tile the weight is read from HBM about
        once (then from L2), not once per row tile."""
        pid_n = tl.program_id(1)
        split = tl.program_id(2)
        kb_first = split * per_split
        kb_end = tl.minimum(kb_first + per_split, tl.cdiv(K, BLOCK_K))
        scaled_block_tile(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr + split.to(tl.int64) * stride_cs,
                          tl.program_id(0), pid_n, kb_first, kb_end, M, N, K, stride_am, stride_asm, stride_ask,
                          stride_bn, stride_bsn, stride_bsk, stride_cm, group_n, HAS_BIAS, BLOCK_M, BLOCK_N,
                          BLOCK_K, B_TMA)


def splitk_matmul(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int,
                  group_k: int | None, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                  config: SplitKConfig | tuple | None = None, unreduced: bool = False
                  ) -> torch.Tensor | SplitKPartials:
    """The split-K GEMM over already-quantised activations: xq [M, K] fp8 with x_scale [M, ceil(K / G)] (any
    strides; G = group_k, or CHANNEL_ACT_GROUP per channel) -> [M, N] in out_dtype. Arguments as w8a8_matmul's.
    `unreduced`: with more than one split, the partials are returned unsummed (SplitKPartials) for the kernel
    that reads the output next to sum; with one split the output, as always."""
    m, n, k, block_k, stride_bsn, stride_bsk, group_n = gemm_operands(xq, x_scale, weight, scale, group_n, group_k)
    if m == 0:
        return torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if config is None:
        config = splitk_config(m, n, k, block_k, device_sms(xq))
    cfg = SplitKConfig(*config)
    block_m = cfg.block_m or block_m_for(m)
    assert block_m >= 16 and block_m & (block_m - 1) == 0, f"SplitKConfig.block_m {block_m}: a power of two >= 16"
    per_split, splits = split_sizes(-(-k // block_k), cfg.splits)
    # one split: the GEMM kernel writes the output [M, N]; else fp32 partials [splits, M, N] (no memset: each
    # element is written by exactly one program), summed in split order by reduce_splits or the next kernel
    part = torch.empty(m, n, dtype=out_dtype, device=xq.device) if splits == 1 else \
        torch.empty(splits, m, n, dtype=torch.float32, device=xq.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n), splits)
    gemm_bias = bias is not None and splits == 1
    # a TMA descriptor needs a 16-byte aligned base and row stride (fp8: 16 values): else plain loads
    tma = cfg.tma and weight.stride(0) % 16 == 0 and weight.data_ptr() % 16 == 0 and device_has_tma(weight)
    b = TensorDescriptor.from_tensor(weight, [cfg.block_n, block_k]) if tma else weight
    _splitk_kernel[grid](xq, x_scale, b, scale, bias if gemm_bias else scale, part, m, n, k, per_split,
                         xq.stride(0), x_scale.stride(0), x_scale.stride(1), weight.stride(0), stride_bsn,
                         stride_bsk, part.stride(0) if splits > 1 else 0, n, group_n, HAS_BIAS=gemm_bias,
                         BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, B_TMA=tma, num_warps=cfg.warps,
                         num_stages=cfg.stages)
    if splits == 1:
        return part
    partials = SplitKPartials(part, bias, out_dtype)
    return partials if unreduced else partials.reduce()


def splitk_scaled_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int,
                         group_k: int | None, bias: torch.Tensor | None = None, scale_ub: float | None = None,
                         config: SplitKConfig | tuple | None = None) -> torch.Tensor:
    """W8A8 as fp8_gemm.block_scaled_matmul (x quantised per token and group, one kernel) with the split-K GEMM:
    x [M, K] -> [M, N] in x's dtype."""
    xq, x_scale = quantize_groups(x, group_k or CHANNEL_ACT_GROUP, scale_ub)
    return splitk_matmul(xq, x_scale, weight, scale, group_n, group_k, x.dtype, bias, config)

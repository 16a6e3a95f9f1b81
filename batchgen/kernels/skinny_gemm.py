"""Split-K GEMM for decode-sized M (<= 64) in bf16 / fp16 / fp32: out [M, N] = x [M, K] @ weight [N, K]^T (+ bias),
what F.linear computes, for the fused decoders' projections at decode (engine.decode_gemm: triton_splitk, opt-in).

Why: at M <= 64 a GEMM is a stream of the weight. cuBLASLt reaches 1.2-1.5x the weight bytes' time at the copy
bandwidth where N or K of 3,072-3,584 leave too few column tiles (and adds its own split-K reduce kernel). Here, as
in kernels/fp8_splitk.py (the scheme and its shared pieces: kernels/splitk_common.py), program (column tile, split,
row tile) takes the K blocks [split * per_split, (split + 1) * per_split) of BLOCK_K columns (the last one masked:
K need not be a multiple of BLOCK_K), accumulates tl.dot(x, w^T) in fp32 and writes an fp32 partial to a workspace
[SPLITS, M, N]; the shared reduce kernel sums the partials in split order, adds the bias in fp32 and rounds once.
With one split the GEMM kernel writes the output itself. Deterministic (no atomics), CUDA-graph capturable (no
memset, no host sync: the workspace's shape follows M).

Not measured yet: bench/skinny_gemm.py times it against F.linear from CUDA-graph replay and sweeps configs.
`use_triton=False` (CPU without the interpreter) runs the reference, F.linear.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from batchgen.kernels.splitk_common import (block_m_for, device_sms, reduce_splits, split_count, split_sizes,
                                           store_tile, workspace)

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

MAX_ROWS = 64  # the regime: decode steps of <= 64 sequences (more rows: F.linear)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    splits: int  # requested K splits; the launch uses ceil(blocks / ceil(blocks / splits)): none empty
    warps: int
    stages: int


def skinny_config(m: int, n: int, k: int, itemsize: int = 2, sms: int = 132) -> SkinnyConfig:
    """Default launch config (not yet tuned on a GPU): 64-column tiles; 16-bit inputs: BLOCK_K 256 at BLOCK_M 16
    (4 stages, ~160 KB of shared memory), else 128 (5 stages at BLOCK_M 32, 4 at 64); fp32: BLOCK_K 64. Splits:
    splitk_common.split_count (the fewest giving >= 2 programs per SM, even over K's blocks where cheap)."""
    block_n, block_m = 64, block_m_for(m)
    if itemsize > 2:
        block_k, stages = 64, 3
    elif block_m <= 16:
        block_k, stages = 256, 4
    else:
        block_k, stages = 128, 5 if block_m <= 32 else 4
    return SkinnyConfig(block_n, block_k, split_count(m, n, -(-k // block_k), block_n, sms), 4, stages)


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, per_split, stride_xm, stride_wn, stride_cs,
                       stride_cm, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (column tile, split, row tile): sum over its k blocks of x[rows, blk] @ w[cols, blk]^T in fp32,
        stored (+ bias, in c's dtype) at c + split * stride_cs. Rows / columns past the edge wrap (loads in
        bounds) and are not stored; columns past K load as 0 (masked)."""
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        pid_m = tl.program_id(2)
        kb_first = split * per_split
        kb_end = tl.minimum(kb_first + per_split, tl.cdiv(K, BLOCK_K))
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = kb_first * BLOCK_K + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(kb_first, kb_end):
            k_left = K - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=tl.arange(0, BLOCK_K)[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=tl.arange(0, BLOCK_K)[:, None] < k_left, other=0.0)
            acc += tl.dot(a, b, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        store_tile(acc, bias_ptr, c_ptr + split.to(tl.int64) * stride_cs, pid_m, pid_n, M, N, stride_cm, HAS_BIAS,
                   BLOCK_M, BLOCK_N)


def triton_runs(x: torch.Tensor) -> bool:
    """Whether skinny_linear's Triton path can run for x: on CUDA, or on CPU under TRITON_INTERPRET=1."""
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | tuple | None = None, use_triton: bool | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias [N] -> [M, N] in x's dtype, M <= MAX_ROWS, all three of one dtype
    (bf16, fp16 or fp32). use_triton None: the Triton path where it runs (triton_runs), else F.linear."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.shape[0] <= MAX_ROWS, f"skinny_linear takes <= {MAX_ROWS} rows, got {x.shape[0]}"
    assert x.dtype == weight.dtype and x.dtype in DTYPES and (bias is None or bias.dtype == x.dtype)
    if not (triton_runs(x) if use_triton is None else use_triton):
        return F.linear(x, weight, bias)
    (m, k), n = x.shape, weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()  # the kernel steps K with unit stride
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    cfg = SkinnyConfig(*(config or skinny_config(m, n, k, x.element_size(), device_sms(x))))
    block_m = block_m_for(m)
    per_split, splits = split_sizes(-(-k // cfg.block_k), cfg.splits)
    part = workspace(out, splits)  # out itself (one split) or fp32 partials [splits, M, N]
    gemm_bias = bias is not None and splits == 1
    grid = (triton.cdiv(n, cfg.block_n), splits, triton.cdiv(m, block_m))
    _skinny_kernel[grid](x, weight, bias if gemm_bias else x, part, m, n, k, per_split, x.stride(0),
                         weight.stride(0), part.stride(0) if splits > 1 else 0, n, HAS_BIAS=gemm_bias,
                         PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m,
                         BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.warps, num_stages=cfg.stages)
    reduce_splits(part, bias, out)
    return out

"""FP8 GEMMs: out [M, N] = x [M, K] @ dequant(weight [N, K])^T (+ bias), the one entry point the fused decoders'
FP8 projections call (`fp8_linear`), with three paths:

  - reference (CPU, or weights the checkpoint keeps weight-only): fp8_quant.linear_ref, weights dequantised in
    fp32, activations as they are;
  - per-channel weight scales on CUDA: x quantised per token (fp8_quant.quantize_rows), then torch._scaled_mm with
    row-wise scales (cuBLASLt / CUTLASS on sm90; bf16 output only);
  - block weight scales (and per-channel ones with fp16/fp32 activations): `block_scaled_matmul`, one Triton kernel
    that quantises each [BLOCK_M, group_k] tile of x per token in registers (the per-token-group scheme of
    DeepSeek / Qwen3-FP8 checkpoints) and accumulates fp8 dots times both scales in fp32. The kernel re-quantises
    the same x tile in every column program: x is small in a decode step (M <= 512 rows, read from L2), and
    fusing saves a kernel and an [M, K] fp8 round trip per GEMM.

Every path is CUDA-graph capturable: no host syncs, outputs whose shapes follow x's and the weight's only.
"""

from __future__ import annotations

import torch

from batchgen.kernels.fp8_quant import FP8_DTYPE, linear_ref, quantize_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

CHANNEL_ACT_GROUP = 128  # activation group of the Triton kernel over per-channel weights (group_k None)

if triton is not None:
    @triton.jit
    def _block_scaled_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                             stride_wsn, stride_wsk, group_n, scale_ub,
                             HAS_BIAS: tl.constexpr, HAS_UB: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (n tile, m tile). BLOCK_K is the activation group and the weight's group_k: each k step
        reads one weight-scale column (stride_wsk 0: per-channel scales, one for every k)."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
        ws_cols = ws_ptr + (offs_n // group_n) * stride_wsn  # [BLOCK_N] pointers to each column's scale row
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k = kb * BLOCK_K + offs_k
            mask_k = k < K
            x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_M]: this token group's absolute max
            if HAS_UB:
                amax = tl.minimum(amax, scale_ub)
            x_scale = tl.maximum(amax, 1e-10) / 448.0
            xq = tl.clamp(tl.div_rn(x, x_scale[:, None]), -448.0, 448.0).to(tl.float8e4nv)
            w = tl.load(w_cols + k[:, None], mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            w_scale = tl.load(ws_cols + kb * stride_wsk, mask=mask_n, other=0.0)  # [BLOCK_N]
            acc += tl.dot(xq, w) * x_scale[:, None] * w_scale[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def default_config(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for M rows. Decode steps (M <= 64) are weight-bandwidth bound:
    narrow column tiles give the ~132 SMs of an H200 enough programs (N 4096 / 32 = 128). Not tuned on the GPU yet:
    bench/fp8_gemm.py sweeps these and reports the fastest per shape."""
    if m <= 16:
        return 16, 32, 4, 4
    if m <= 64:
        return (32 if m <= 32 else 64), 64 if n >= 16384 else 32, 4, 4
    return 64, 128, 4, 3


def block_scaled_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int,
                        group_k: int | None, bias: torch.Tensor | None = None, scale_ub: float | None = None,
                        config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """W8A8 with block (or per-channel: group_k None, activations then quantised per CHANNEL_ACT_GROUP columns)
    weight scales, one Triton launch: x [M, K] (bf16/fp16/fp32) -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.dtype == FP8_DTYPE and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    if group_k is None:  # per-channel [N, 1]: the same scale for every k step
        assert scale.shape == (n, 1)
        block_k, stride_wsn, stride_wsk, group_n = CHANNEL_ACT_GROUP, scale.stride(0), 0, 1
    else:
        assert scale.shape == (-(-n // group_n), -(-k // group_k)), (scale.shape, n, k, group_n, group_k)
        block_k, stride_wsn, stride_wsk = group_k, scale.stride(0), scale.stride(1)
    block_m, block_n, warps, stages = config or default_config(m, n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _block_scaled_kernel[grid](x, weight, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0),
                               weight.stride(0), out.stride(0), stride_wsn, stride_wsk, group_n, scale_ub or 0.0,
                               HAS_BIAS=bias is not None, HAS_UB=scale_ub is not None, BLOCK_M=block_m,
                               BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def rowwise_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale_row: torch.Tensor,
                      bias: torch.Tensor | None = None, scale_ub: float | None = None) -> torch.Tensor:
    """W8A8 with per-channel weight scales: x quantised per token (one Triton kernel), then torch._scaled_mm with
    row-wise scales. x [M, K] bf16, weight [N, K] fp8, scale_row [1, N] fp32 -> [M, N] bf16. Hazard: on CUDA
    _scaled_mm needs K and N multiples of 16 and bf16 output for row-wise scales."""
    xq, x_scale = quantize_rows(x, scale_ub)  # [M, K] fp8, [M, 1]
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale_row, out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int | None,
               bias: torch.Tensor | None = None, act_quant: bool = True, scale_ub: float | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K])^T + bias -> [..., N] in x's dtype: the path for the device (see the
    module docstring). act_quant False: a weight-only checkpoint, the reference path everywhere."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if not x.is_cuda or not act_quant or triton is None:
        out = linear_ref(x2, weight, scale, group_n, group_k, bias)
    elif group_k is None and x.dtype == torch.bfloat16:
        out = rowwise_scaled_mm(x2, weight, scale.view(1, -1), bias, scale_ub)
    else:
        out = block_scaled_matmul(x2, weight, scale, group_n, group_k, bias, scale_ub)
    return out.reshape(*x.shape[:-1], weight.shape[0])

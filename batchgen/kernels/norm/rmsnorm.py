"""Fused residual add + RMSNorm for the decode step (Triton), and its torch reference.

    rmsnorm(x, w, eps)                  -> w * norm(x)
    rmsnorm(x, w, eps, residual=r)      -> r <- r + x (in place), then w * norm(r)
    rmsnorm(x, w, eps, residual=r, x_scale=m)  -> r <- r + x * m (Granite's residual_multiplier), then w * norm(r)

That is the pre-norm decoder's "add the sublayer's output to the residual stream, normalise for the next
sublayer" in one pass over the row. Rounding follows transformers' Llama RMSNorm exactly: the sum is rounded
to the activation dtype, the variance is taken in fp32, the normalised row is rounded to the activation dtype
before the weight multiplies it (so bf16 results match the eager model bit for bit, up to the order of the
variance's fp32 sum). With `unit_offset` (Gemma) the weight is stored as an offset from 1 and the product
(1 + w) * norm(x) is taken in fp32 and rounded once, as Gemma's RMSNorm does; with `weight_fp32` (OLMo2) the
product w * norm(x) is taken in fp32 and rounded once. `x_scale`'s product is rounded to the activation dtype
before the add, as the eager `residual + out * m` rounds it.

Rows may be strided (x: a column slice of a wider tensor, such as the q part of a fused QKV output), and `out`
may be x itself: each program reads its whole row before it writes it (no residual then).

Two hand-offs with the FP8 GEMMs around it (the fused decoders ask for them, quant/fusion.py; CUDA only):
  - `quant`: the normalised row, rounded to the activation dtype as it would be stored, is quantised per token and
    group as quantize_groups would quantise the stored tensor (fp8_quant.quantize_store_row: the same arithmetic)
    and handed over as QuantizedActs, in place of the activation-dtype output: the next GEMM's quantiser is gone;
  - x a SplitKPartials: the previous split-K GEMM's fp32 partials, summed in split order with its bias and rounded
    once to the activation dtype as its reduction kernel would (splitk_common.sum_splits), then the add and norm:
    the reduction kernel is gone.
"""

from __future__ import annotations

import torch

from batchgen.kernels.fp8.quant import ActQuant, QuantizedActs, group_quant_buffers
from batchgen.kernels.fp8.splitk_common import SplitKPartials

try:
    import triton
    import triton.language as tl

    from batchgen.kernels.fp8.quant import quantize_store_row
    from batchgen.kernels.fp8.splitk_common import TL_DTYPES, sum_splits
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

if triton is not None:
    @triton.jit
    def add_residual_row(x, res_ptrs, mask):
        """The pre-norm residual add of one row: residual <- x + residual, rounded to the residual's dtype as a
        torch add rounds it, stored in place; returns the sum (the row the norm reads). Norm kernels share it."""
        r = tl.load(res_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_ptrs, x, mask=mask)
        return x

    @triton.jit
    def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, bias_ptr, q_ptr, s_ptr, num_cols, eps, x_scale, scale_ub,
                        stride_x, stride_res, stride_out, stride_q, stride_sm, stride_sg, ACT_DTYPE: tl.constexpr,
                        SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                        HAS_X_SCALE: tl.constexpr, UNIT_OFFSET: tl.constexpr, WEIGHT_FP32: tl.constexpr,
                        QUANT_GROUP: tl.constexpr, HAS_UB: tl.constexpr, BLOCK: tl.constexpr):
        """One program per row. x: the row at x_ptr + row * stride_x, or (SPLITS > 0) the sum of a split-K GEMM's
        fp32 partials [SPLITS, M, num_cols] at x_ptr (stride_x between splits) + bias, rounded to ACT_DTYPE.
        Output: the row at out_ptr + row * stride_out, or (QUANT_GROUP > 0) rounded to ACT_DTYPE and quantised per
        QUANT_GROUP columns: fp8 at q_ptr + row * stride_q, scales at s_ptr + row * stride_sm + group * stride_sg."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < num_cols
        if SPLITS > 0:  # the partials [S, M, N] are contiguous: row r's column c at r * N + c in each split
            x = sum_splits(x_ptr, row * num_cols + cols, mask, stride_x, bias_ptr, cols, SPLITS, HAS_BIAS)
            x = x.to(ACT_DTYPE)
        else:
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_X_SCALE:  # the product rounded to the activation dtype, then the add (two roundings, as eager)
            x = (x.to(tl.float32) * x_scale).to(x.dtype)
        if HAS_RESIDUAL:
            x = add_residual_row(x, res_ptr + row * stride_res + cols, mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            out = (xf * rstd) * (1.0 + w)
        elif WEIGHT_FP32:
            out = w * (xf * rstd)
        else:
            out = w * (xf * rstd).to(x.dtype).to(tl.float32)
        if QUANT_GROUP > 0:  # the row as stored in ACT_DTYPE (0 past num_cols: x and w load 0 there), quantised
            y = out.to(ACT_DTYPE).to(tl.float32)
            quantize_store_row(y, 0, num_cols, q_ptr + row * stride_q, s_ptr + row * stride_sm, stride_sg, scale_ub,
                               HAS_UB, BLOCK, QUANT_GROUP)
        else:
            tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                unit_offset: bool = False, weight_fp32: bool = False, x_scale: float | None = None) -> torch.Tensor:
    """x, residual: [T, N]; weight: [N]. Returns [T, N]; updates `residual` in place when given."""
    if x_scale is not None:
        x = x * x_scale
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (y * (1.0 + weight.float())).to(x.dtype)
    if weight_fp32:
        return (weight * y).to(x.dtype)  # as OLMo2's module: the weight (any dtype) promoted to fp32
    return weight * y.to(x.dtype)


def _num_warps(block: int) -> int:
    """Warps a row's program runs: 16 for rows of >= 4096 (FP8 W1 on an H200 4.59 -> 4.53 s against 8 with the FP8
    hand-offs, 2026-12-02). The same count with and without the hand-offs: the warps set the layout of the row's
    fp32 sum of squares, so the fused kernels keep the unfused ones' bits (tests/quant/test_fp8_fusion_kernels.py)."""
    return 16 if block >= 4096 else 4


def rmsnorm(x: torch.Tensor | SplitKPartials, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            use_triton: bool = True, unit_offset: bool = False, weight_fp32: bool = False,
            out: torch.Tensor | None = None, x_scale: float | None = None,
            quant: ActQuant | None = None) -> torch.Tensor | QuantizedActs:
    """`out`: where the result goes ([T, N], may be x itself when there is no residual); default a new tensor.
    `x_scale`: x is multiplied by it (rounded) first. Triton only (see the module docstring): x a SplitKPartials
    (a split-K GEMM's [T, N] output, summed here); `quant`: the result returned as QuantizedActs (no `out`)."""
    partials = x if isinstance(x, SplitKPartials) else None
    if not use_triton:
        assert partials is None and quant is None, "the torch reference takes no FP8 hand-offs"
        y = rmsnorm_ref(x, weight, eps, residual, unit_offset, weight_fp32, x_scale)
        return y if out is None else out.copy_(y)
    num_rows, num_cols = x.shape
    dtype = x.dtype if partials is None else partials.dtype
    src = x if partials is None else partials.part  # [T, N] (unit column stride), or [S, T, N] contiguous
    assert src.stride(-1) == 1 and (partials is None or src.is_contiguous())
    assert residual is None or (residual.is_contiguous() and src.is_contiguous())
    block = triton.next_power_of_2(num_cols)
    if quant is None:
        out = torch.empty(num_rows, num_cols, dtype=dtype, device=src.device) if out is None else out
        assert out.shape == x.shape and out.stride(1) == 1 and (residual is None or out.data_ptr() != src.data_ptr())
        q, scale, group, scale_ub = out, out, 0, None  # q, scale: not written
    else:
        assert out is None
        q, scale = group_quant_buffers(num_rows, num_cols, quant.group, src.device)  # [T, N] fp8, [T, G]
        # a group wider than the row's block is one group over the whole row (K <= group: quantize_groups' too)
        out, group, scale_ub = q, min(quant.group, block), quant.scale_ub  # out: not written
    res = residual if residual is not None else src
    has_bias = partials is not None and partials.bias is not None
    _rmsnorm_kernel[(num_rows,)](src, res, weight, out, partials.bias if has_bias else weight, q, scale, num_cols,
                                 eps, 1.0 if x_scale is None else x_scale, scale_ub or 0.0, src.stride(0),
                                 res.stride(0), out.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
                                 ACT_DTYPE=TL_DTYPES[dtype], SPLITS=0 if partials is None else src.shape[0],
                                 HAS_BIAS=has_bias, HAS_RESIDUAL=residual is not None,
                                 HAS_X_SCALE=x_scale is not None, UNIT_OFFSET=unit_offset, WEIGHT_FP32=weight_fp32,
                                 QUANT_GROUP=group, HAS_UB=scale_ub is not None, BLOCK=block,
                                 num_warps=_num_warps(block))
    return out if quant is None else QuantizedActs(q, scale, quant, dtype)

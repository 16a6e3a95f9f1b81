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
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
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
    def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, num_cols, eps, x_scale, stride_x, stride_res, stride_out,
                        HAS_RESIDUAL: tl.constexpr, HAS_X_SCALE: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                        WEIGHT_FP32: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < num_cols
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


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            use_triton: bool = True, unit_offset: bool = False, weight_fp32: bool = False,
            out: torch.Tensor | None = None, x_scale: float | None = None) -> torch.Tensor:
    """`out`: where the result goes ([T, N], may be x itself when there is no residual); default a new tensor.
    `x_scale`: x is multiplied by it (rounded) first."""
    if not use_triton:
        y = rmsnorm_ref(x, weight, eps, residual, unit_offset, weight_fp32, x_scale)
        return y if out is None else out.copy_(y)
    num_rows, num_cols = x.shape
    assert x.stride(1) == 1 and (residual is None or (residual.is_contiguous() and x.is_contiguous()))
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    assert out.shape == x.shape and out.stride(1) == 1 and (residual is None or out.data_ptr() != x.data_ptr())
    block = triton.next_power_of_2(num_cols)
    res = residual if residual is not None else x
    _rmsnorm_kernel[(num_rows,)](x, res, weight, out, num_cols, eps, 1.0 if x_scale is None else x_scale,
                                x.stride(0), res.stride(0), out.stride(0),
                                HAS_RESIDUAL=residual is not None, HAS_X_SCALE=x_scale is not None,
                                UNIT_OFFSET=unit_offset,
                                WEIGHT_FP32=weight_fp32, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out

"""Fused residual add + RMSNorm for the decode step (Triton), and its torch reference.

    rmsnorm(x, w, eps)                  -> w * norm(x)
    rmsnorm(x, w, eps, residual=r)      -> r <- r + x (in place), then w * norm(r)

That is the pre-norm decoder's "add the sublayer's output to the residual stream, normalise for the next
sublayer" in one pass over the row. Rounding follows transformers' Llama RMSNorm exactly: the sum is rounded
to the activation dtype, the variance is taken in fp32, the normalised row is rounded to the activation dtype
before the weight multiplies it (so bf16 results match the eager model bit for bit, up to the order of the
variance's fp32 sum). With `unit_offset` (Gemma) the weight is stored as an offset from 1 and the product
(1 + w) * norm(x) is taken in fp32 and rounded once, as Gemma's RMSNorm does.
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
    def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, num_cols, eps,
                        HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < num_cols
        x = tl.load(x_ptr + row * num_cols + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * num_cols + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # rounded like a torch add
            tl.store(res_ptr + row * num_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            out = (xf * rstd) * (1.0 + w)
        else:
            out = w * (xf * rstd).to(x.dtype).to(tl.float32)
        tl.store(out_ptr + row * num_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None, unit_offset: bool = False) -> torch.Tensor:
    """x, residual: [T, N]; weight: [N]. Returns [T, N]; updates `residual` in place when given."""
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (y * (1.0 + weight.float())).to(x.dtype)
    return weight * y.to(x.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            use_triton: bool = True, unit_offset: bool = False) -> torch.Tensor:
    if not use_triton:
        return rmsnorm_ref(x, weight, eps, residual, unit_offset)
    num_rows, num_cols = x.shape
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    out = torch.empty_like(x)
    block = triton.next_power_of_2(num_cols)
    _rmsnorm_kernel[(num_rows,)](x, residual if residual is not None else x, weight, out, num_cols, eps,
                                HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=block,
                                num_warps=8 if block >= 4096 else 4)
    return out

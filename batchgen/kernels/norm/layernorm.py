"""Fused residual add + LayerNorm for the decode step (Triton), and its torch reference.

    layernorm(x, w, b, eps)                 -> (x - mean) * rstd * w + b
    layernorm(x, w, b, eps, residual=r)     -> r <- r + x (in place), then LayerNorm of r

The pre-norm decoder's "add the sublayer's output to the residual stream, normalise for the next sublayer" of
the GPT-style families (Starcoder2) in one pass over the row, in place of torch's add kernel then its
layer_norm kernel. Rounding follows torch's eager `residual.add_(x)` then `F.layer_norm(...)`:
  - the sum is taken in fp32 and rounded once to the activation dtype (as a torch add of two bf16 tensors);
  - the mean and the biased variance of that rounded row are taken in fp32, rstd = rsqrt(var + eps);
  - w * ((x - mean) * rstd) + b is taken in fp32 (weight and bias upcast to fp32, as torch's kernels do for
    bf16 weights) and rounded once to the output dtype.
Torch's CUDA kernel gets mean and variance by Welford over its threads, its CPU kernel by a cascade of row
moments; this kernel takes the plain two-pass sums (mean, then the squared deviations) in Triton's reduction
order. Results may therefore differ from torch's in the last bit, as the RMSNorm kernel's may from the eager
model; the reference (`use_triton=False`) is torch's own ops, bit for bit.

One program per row, the whole row in one block: the reduction order over a row depends on the row length only,
never on the number of rows, so the kernel is batch-invariant (engine.deterministic).
Rows of x may be strided (stride(1) == 1), and `out` may be x itself when there is no residual: each program
reads its whole row before it writes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    from batchgen.kernels.norm.rmsnorm import add_residual_row
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

if triton is not None:
    @triton.jit
    def _layernorm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, num_cols, eps, stride_x, stride_res, stride_out,
                          HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < num_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = add_residual_row(x, res_ptr + row * stride_res + cols, mask)
        xf = x.to(tl.float32)  # the rounded sum, as torch's layer_norm reads it
        mean = tl.sum(xf, axis=0) / num_cols  # masked columns load 0: they add nothing
        diff = tl.where(mask, xf - mean, 0.0)  # ... but would add mean^2 to the variance: zeroed
        rstd = tl.rsqrt(tl.sum(diff * diff, axis=0) / num_cols + eps)  # biased variance, as torch
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = w * (diff * rstd)  # all fp32, rounded once at the store
        if HAS_BIAS:
            out += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def layernorm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """x, residual: [T, N]; weight, bias: [N]. Returns [T, N]; updates `residual` in place when given.
    Exactly the eager module's ops (the add rounded like `residual + hidden_states`), so the bits are torch's."""
    if residual is not None:
        x = residual.add_(x)
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
              residual: torch.Tensor | None = None, use_triton: bool = True,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """`out`: where the result goes ([T, N], may be x itself when there is no residual); default a new tensor."""
    if not use_triton:
        y = layernorm_ref(x, weight, bias, eps, residual)
        return y if out is None else out.copy_(y)
    num_rows, num_cols = x.shape
    assert x.stride(1) == 1 and (residual is None or (residual.is_contiguous() and x.is_contiguous()))
    assert weight.is_contiguous() and (bias is None or bias.is_contiguous())
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    assert out.shape == x.shape and out.stride(1) == 1 and (residual is None or out.data_ptr() != x.data_ptr())
    block = triton.next_power_of_2(num_cols)
    res = residual if residual is not None else x
    _layernorm_kernel[(num_rows,)](x, res, weight, weight if bias is None else bias, out, num_cols, eps,
                                   x.stride(0), res.stride(0), out.stride(0), HAS_RESIDUAL=residual is not None,
                                   HAS_BIAS=bias is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out

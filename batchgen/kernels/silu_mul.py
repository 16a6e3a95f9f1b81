"""SiLU-gated MLP activation over the fused gate/up projection (Triton), and its torch reference.

x: [T, 2 * I] = [gate | up] -> silu(gate) * up: [T, I]. Rounded as transformers' eager MLP
(`act_fn(gate_proj(x)) * up_proj(x)`): silu rounded to the activation dtype, then the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

if triton is not None:
    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, num_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < num_cols
        gate = tl.load(x_ptr + row * 2 * num_cols + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * 2 * num_cols + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * num_cols + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor, use_triton: bool = True) -> torch.Tensor:
    if not use_triton:
        return silu_mul_ref(x)
    num_rows, num_cols = x.shape[0], x.shape[1] // 2
    assert x.is_contiguous() and x.shape[1] % 2 == 0
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(num_rows, triton.cdiv(num_cols, block))](x, out, num_cols, BLOCK=block, num_warps=4)
    return out

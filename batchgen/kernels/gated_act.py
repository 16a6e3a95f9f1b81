"""Gated MLP activation over the fused gate/up projection (Triton), and its torch reference.

x: [T, 2 * I] = [gate | up] -> act(gate) * up: [T, I], with act SiLU (Llama, Qwen, Mistral) or the
tanh-approximated GELU (Gemma's `gelu_pytorch_tanh`). Rounded as transformers' eager MLP
(`act_fn(gate_proj(x)) * up_proj(x)`): the activation computed in fp32 and rounded to the activation dtype,
then the product.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

ACTIVATIONS = ("silu", "gelu_tanh")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

if triton is not None:
    @triton.jit
    def _gated_act_kernel(x_ptr, out_ptr, num_cols, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < num_cols
        gate = tl.load(x_ptr + row * 2 * num_cols + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * 2 * num_cols + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        if GELU_TANH:  # 0.5 g (1 + tanh(y)), y = sqrt(2/pi) (g + 0.044715 g^3), as torch computes it
            y = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
            # tanh from exp, odd by construction: 1 - 2 / (exp(2|y|) + 1) is accurate for large |y|, where
            # the form in exp(2y) loses the small 1 + tanh(y) of a negative gate (a CPU emulation over bf16
            # gates: as many bf16 results differ from torch's GELU as with torch.tanh itself)
            t = 1.0 - 2.0 / (tl.exp(2.0 * tl.abs(y)) + 1.0)
            act = 0.5 * g * (1.0 + tl.where(y < 0.0, -t, t))
        else:
            act = g / (1.0 + tl.exp(-g))
        act = act.to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * num_cols + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def gated_act_ref(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def gated_act(x: torch.Tensor, activation: str = "silu", use_triton: bool = True) -> torch.Tensor:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: one of {ACTIVATIONS}")
    if not use_triton:
        return gated_act_ref(x, activation)
    num_rows, num_cols = x.shape[0], x.shape[1] // 2
    assert x.is_contiguous() and x.shape[1] % 2 == 0
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    block = 1024
    _gated_act_kernel[(num_rows, triton.cdiv(num_cols, block))](x, out, num_cols, GELU_TANH=activation == "gelu_tanh",
                                                                BLOCK=block, num_warps=4)
    return out

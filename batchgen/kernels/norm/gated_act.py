"""Gated MLP activation over the fused gate/up projection (Triton), and its torch reference.

x: [T, 2 * I] = [gate | up] -> act(gate) * up: [T, I], with act SiLU (Llama, Qwen, Mistral) or the
tanh-approximated GELU (Gemma's `gelu_pytorch_tanh`). Rounded as transformers' eager MLP
(`act_fn(gate_proj(x)) * up_proj(x)`): the activation computed in fp32 and rounded to the activation dtype,
then the product.

`quant` (the fused decoders ask for it where the down projection's FP8 GEMM quantises its input per token and
group, quant/fusion.py; CUDA only): the product, rounded to the activation dtype as it would be stored, is
quantised as quantize_groups would quantise the stored tensor (fp8_quant.quantize_store_row: the same arithmetic)
and returned as QuantizedActs: the down GEMM's quantiser is gone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from batchgen.kernels.fp8.quant import ActQuant, QuantizedActs, group_quant_buffers

try:
    import triton
    import triton.language as tl

    from batchgen.kernels.fp8.quant import quantize_store_row
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

ACTIVATIONS = ("silu", "gelu_tanh")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

if triton is not None:
    @triton.jit
    def _gated_act_kernel(x_ptr, out_ptr, s_ptr, num_cols, stride_sm, stride_sg, scale_ub, GELU_TANH: tl.constexpr,
                          QUANT_GROUP: tl.constexpr, HAS_UB: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row, BLOCK columns). Output: the row's columns at out_ptr + row * num_cols, in out_ptr's dtype:
        the activation dtype, or (QUANT_GROUP > 0, BLOCK a multiple of it) fp8, the product as rounded to the
        activation dtype quantised per QUANT_GROUP columns, scales at s_ptr + row * stride_sm + group * stride_sg."""
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
        if QUANT_GROUP > 0:  # the product as stored in the activation dtype (0 past num_cols), quantised
            y = (act * up).to(gate.dtype).to(tl.float32)
            quantize_store_row(y, tl.program_id(1) * BLOCK, num_cols, out_ptr + row * num_cols,
                               s_ptr + row * stride_sm, stride_sg, scale_ub, HAS_UB, BLOCK, QUANT_GROUP)
        else:
            tl.store(out_ptr + row * num_cols + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def gated_act_ref(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def gated_act(x: torch.Tensor, activation: str = "silu", use_triton: bool = True,
              quant: ActQuant | None = None) -> torch.Tensor | QuantizedActs:
    """x [T, 2 I] -> [T, I]; `quant` (Triton only): returned as QuantizedActs (see the module docstring)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: one of {ACTIVATIONS}")
    if not use_triton:
        assert quant is None, "the torch reference takes no FP8 hand-off"
        return gated_act_ref(x, activation)
    num_rows, num_cols = x.shape[0], x.shape[1] // 2
    assert x.is_contiguous() and x.shape[1] % 2 == 0
    if quant is None:
        out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
        scale, group, scale_ub = out, 0, None  # scale: not written
    else:
        out, scale = group_quant_buffers(num_rows, num_cols, quant.group, x.device)  # [T, I] fp8, [T, G]
        group, scale_ub = quant.group, quant.scale_ub
    block = max(1024, group)  # whole groups a program (both powers of two)
    _gated_act_kernel[(num_rows, triton.cdiv(num_cols, block))](
        x, out, scale, num_cols, scale.stride(0), scale.stride(1), scale_ub or 0.0,
        GELU_TANH=activation == "gelu_tanh", QUANT_GROUP=group, HAS_UB=scale_ub is not None, BLOCK=block,
        num_warps=4)
    return out if quant is None else QuantizedActs(out, scale, quant, x.dtype)

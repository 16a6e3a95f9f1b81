"""Shared blocks of the fused forwards: each is one or two kernels over a whole step, with a torch reference of
the same rounding on CPU (`use_triton=False`), so a model file reads as its layer order.

Shapes: B rows (a decode step: one new token per sequence; a packed step: T tokens of prefill chunks and
decodes), hidden size E, H query heads, Hkv KV heads, head dim D.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.attention import backend
from batchgen.attention.backend import AttentionMetadata
from batchgen.kernels.rmsnorm import rmsnorm
from batchgen.kernels.rope_kv import rope_kv
from batchgen.kernels.gated_act import gated_act

__all__ = ["StepInputs", "add_rmsnorm", "gated_mlp", "self_attention"]


@dataclass
class StepInputs:
    """What every layer of one step reads besides its weights. A decode step has one row per sequence; a
    packed step (`packed` set) has one row per token, sequences of any length, packed decodes first."""

    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64: each row's cache slot (decode padding rows: the trash slot)
    block_tables: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32, the step's tokens included (0 marks a decode padding row)
    cos: torch.Tensor  # [B, D] rotary cos at each position, in the activation dtype
    sin: torch.Tensor  # [B, D]
    use_triton: bool
    max_seq_len: int | None  # host-known bound on seq_lens (the CPU reference uses it); None: read it
    packed: AttentionMetadata | None = None  # a packed step's attention metadata; None: a decode step


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                use_triton: bool, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm(x + residual) with `residual` updated in place to x + residual (or RMSNorm(x) without one).
    `unit_offset`: Gemma's norm, whose weight is an offset from 1."""
    return rmsnorm(x, weight, eps, residual=residual, use_triton=use_triton, unit_offset=unit_offset)


def self_attention(h: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None,
                   o_weight: torch.Tensor, o_bias: torch.Tensor | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, step: StepInputs, num_heads: int, num_kv_heads: int, scale: float,
                   qk_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """QKV GEMM -> rotary + K/V cache write + paged attention -> output GEMM. h: [B, E] -> [B, E].
    `qk_norm`: per-head RMSNorm of q and k before the rotation (Qwen3; weights [2, D]), which keeps the
    rotary in its own kernel; otherwise on CUDA a decode step's rotary and cache write run inside the attention
    kernel. A packed step writes its K/V with the rotary, then attends (prefill kernel; decode kernel for its
    decode rows)."""
    qkv = F.linear(h, qkv_weight, qkv_bias)  # [B, (H + 2 Hkv) D]
    if step.packed is not None:
        q = rope_kv(qkv, step.cos, step.sin, step.slot_mapping, k_cache, v_cache, num_heads, num_kv_heads,
                    qk_norm=qk_norm, use_triton=step.use_triton)  # [B, H, D]
        attn = backend.attend_cached(step.packed, q, k_cache, v_cache, scale)
    elif step.use_triton and qk_norm is None:
        attn = backend.decode_rope(qkv, step.cos, step.sin, step.slot_mapping, k_cache, v_cache, step.block_tables,
                                   step.seq_lens, scale, num_heads)  # [B, H, D]
    else:
        q = rope_kv(qkv, step.cos, step.sin, step.slot_mapping, k_cache, v_cache, num_heads, num_kv_heads,
                    qk_norm=qk_norm, use_triton=step.use_triton)  # [B, H, D]
        attn = backend.decode(q, k_cache, v_cache, step.block_tables, step.seq_lens, scale, step.use_triton,
                              step.max_seq_len)  # [B, H, D]
    return F.linear(attn.reshape(h.shape[0], -1), o_weight, o_bias)


def gated_mlp(h: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
              use_triton: bool, activation: str = "silu") -> torch.Tensor:
    """down(act(gate(h)) * up(h)) with gate and up as one GEMM ([2 I, E]); act: "silu" or "gelu_tanh".
    h: [B, E] -> [B, E]."""
    return F.linear(gated_act(F.linear(h, gate_up_weight), activation, use_triton=use_triton), down_weight)

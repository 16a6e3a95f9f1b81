"""Shared blocks of the fused forwards: each is one or two kernels over a whole step, with a torch reference of
the same rounding on CPU (`use_triton=False`), so a model file reads as its layer order.

Shapes: B rows (a decode step: one new token per sequence; a packed step: T tokens of prefill chunks and
decodes), hidden size E, H query heads, Hkv KV heads, head dim D.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchgen.attention import backend
from batchgen.attention.backend import AttentionMetadata
from batchgen.kernels.norm.layernorm import layernorm
from batchgen.kernels.norm.rmsnorm import rmsnorm
from batchgen.kernels.attention.rope_kv import QKNorm, rope_kv
from batchgen.kernels.norm.gated_act import gated_act
from batchgen.quant.fusion import HandOffs, input_quant, is_quantized, linear_to_norm, quantized, summed
from batchgen.quant.linear import InputQuant, Linear, LinearInput, LinearOutput, LinearWeight

__all__ = ["Norm", "StepInputs", "GatedMLP", "PlainMLP", "add_norm", "attend_qkv", "mlp_input_quant", "self_attention"]

NORM_KINDS = ("rms", "rms_unit_offset", "rms_fp32_weight", "layer")
PLAIN_ACTIVATIONS = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


@dataclass
class StepInputs:
    """What every layer of one step reads besides its weights. A decode step has one row per sequence; a
    packed step (`packed` set) has one row per token, sequences of any length, packed decodes first."""

    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64: each row's cache slot (decode padding rows: the trash slot)
    block_tables: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32, the step's tokens included (0 marks a decode padding row)
    cos: torch.Tensor  # [B, D] rotary cos at each position, in the activation dtype (OLMo2: fp32)
    sin: torch.Tensor  # [B, D]
    use_triton: bool
    max_seq_len: int | None  # host-known bound on seq_lens (the CPU reference uses it); None: read it
    packed: AttentionMetadata | None = None  # a packed step's attention metadata; None: a decode step
    # engine.deterministic: every row's attention through the batch-invariant per-query kernel
    # (kernels/invariant/attention.py), a decode row and a prefill token alike
    invariant: bool = False
    kv_lens: torch.Tensor | None = None  # [B] int32, invariant only: keys each row sees (position + 1; 0: padding)
    row_seq: torch.Tensor | None = None  # [B] int32, invariant packed steps: each row's sequence; None: row b is b


@dataclass
class Norm:
    """One norm module's parameters and its rounding. kind: "rms" (Llama: the normalised row rounded, then the
    weight), "rms_unit_offset" (Gemma: (1 + w) in fp32, rounded once), "rms_fp32_weight" (OLMo2: w in fp32,
    rounded once), "layer" (LayerNorm with weight and optional bias, kernels/norm/layernorm.py: on CUDA the Triton
    kernel takes w * (x - mean) * rstd + b in fp32 and rounds once, as torch's kernel does, with the mean and
    variance summed in its own order (last-bit differences possible, as with the RMSNorm kernel); on CPU the
    reference is torch's own add and layer_norm, the eager module's bits)."""

    weight: torch.Tensor  # [N]
    eps: float
    kind: str = "rms"
    bias: torch.Tensor | None = None  # [N], "layer" only

    def __post_init__(self) -> None:
        assert self.kind in NORM_KINDS and (self.bias is None or self.kind == "layer")


def add_norm(x: LinearOutput, norm: Norm, residual: torch.Tensor | None, use_triton: bool,
             out: torch.Tensor | None = None, x_scale: float | None = None,
             quant: InputQuant | None = None) -> LinearInput:
    """norm(x + residual) with `residual` updated in place to x + residual (or norm(x) without one).
    x: [B, N] -> [B, N]; `out`: where the result goes (no residual: may be x itself); `x_scale` (RMS kinds:
    Granite's residual_multiplier): x * x_scale, rounded, takes x's place. Quantised GEMMs' hand-offs
    (quant/fusion.py, Triton only): x a split-K GEMM's unsummed output; `quant`: the result quantised for the next
    GEMM. RMS kinds do both inside the norm kernel; "layer" sums first and quantises after it."""
    if norm.kind == "layer":  # the residual add rounded like the eager `residual + hidden_states`
        assert x_scale is None
        y = layernorm(summed(x), norm.weight, norm.bias, norm.eps, residual=residual, use_triton=use_triton, out=out)
        return quantized(y, quant)
    return rmsnorm(x, norm.weight, norm.eps, residual=residual, use_triton=use_triton,
                   unit_offset=norm.kind == "rms_unit_offset", weight_fp32=norm.kind == "rms_fp32_weight", out=out,
                   x_scale=x_scale, quant=quant)


def self_attention(h: LinearInput, qkv_weight: LinearWeight,
                   qkv_bias: torch.Tensor | None, o_weight: LinearWeight, o_bias: torch.Tensor | None,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepInputs, num_heads: int, num_kv_heads: int,
                   scale: float, qk_norm: QKNorm | None = None, sliding_window: int | None = None, *, linear: Linear,
                   fusion: HandOffs | None = None) -> LinearOutput:
    """QKV GEMM -> rotary + K/V cache write + paged attention -> output GEMM. h: [B, E] -> [B, E].
    `qk_norm`: per-head RMSNorm of q and k before the rotation (Qwen3, Gemma3); `sliding_window`: the
    layer's window (None: the whole context); `linear`: the GEMM (the decoder's: plain / quantised, or
    batch-invariant); `fusion` (the decoder's quantised GEMMs' hand-offs): the QKV GEMM's partials summed by the
    attention kernel, its output
    quantised there for the o GEMM, whose output is as `fusion.linear_to_norm` leaves it, for add_norm."""
    if fusion is None:
        qkv = linear(h, qkv_weight, qkv_bias)  # [B, (H + 2 Hkv) D]
    else:
        qkv = fusion.linear_to_attention(h, qkv_weight, qkv_bias)  # or its partials
    attn = attend_qkv(qkv, k_cache, v_cache, step, num_heads, num_kv_heads, scale, qk_norm,
                      sliding_window=sliding_window, quant=input_quant(fusion, o_weight, qkv))
    return linear_to_norm(fusion, linear, attn, o_weight, o_bias)


def attend_qkv(qkv: LinearOutput, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepInputs,
               num_heads: int, num_kv_heads: int, scale: float,
               qk_norm: QKNorm | None = None, rotate_fp32: bool = False,
               sliding_window: int | None = None, softcap: float | None = None,
               quant: InputQuant | None = None) -> LinearInput:
    """Rotary + K/V cache write + paged attention over a step's projected q/k/v. qkv: [B, (H + 2 Hkv) D] ->
    [B, H D]. On CUDA a decode step's rotary and cache write run inside the attention kernel, `qk_norm` (the
    per-head q/k RMSNorm before the rotation: Qwen3, Gemma3) included; `rotate_fp32` (the rotation in fp32,
    rounded once: OLMo2) keeps the rotary in its own kernel (rope_kv), as do the CPU reference, the
    deterministic path (`step.invariant`: every row's key read back from the cache) and packed steps, which
    write their K/V with the rotary, then attend (prefill kernel; decode kernel for their decode rows).
    `sliding_window` / `softcap`: the layer's window and score soft-capping (Gemma2/Gemma3). Quantised GEMMs'
    hand-offs (quant/fusion.py): qkv may be a split-K GEMM's partials (summed by the fused decode kernel, reduced
    first on the other paths), and `quant` asks for the output quantised for the o GEMM, which the fused
    decode kernel does where it can; otherwise the output is a tensor, for that GEMM to quantise."""
    window = {"sliding_window": sliding_window, "softcap": softcap}
    fused_decode = not step.invariant and step.packed is None and step.use_triton and not rotate_fp32
    if not fused_decode:
        qkv = summed(qkv)
    if step.invariant:  # every row alike, its key read back from the cache (no fused rotary decode kernel)
        q = rope_kv(qkv, step.cos, step.sin, step.slot_mapping, k_cache, v_cache, num_heads, num_kv_heads,
                    qk_norm=qk_norm, use_triton=step.use_triton, rotate_fp32=rotate_fp32)  # [B, H, D]
        attn = backend.attend_invariant(q, k_cache, v_cache, step.block_tables, step.kv_lens, step.row_seq, scale,
                                        step.use_triton, **window)
    elif step.packed is not None:
        q = rope_kv(qkv, step.cos, step.sin, step.slot_mapping, k_cache, v_cache, num_heads, num_kv_heads,
                    qk_norm=qk_norm, use_triton=step.use_triton, rotate_fp32=rotate_fp32)  # [B, H, D]
        attn = backend.attend_cached(step.packed, q, k_cache, v_cache, scale, **window)
    elif fused_decode:
        attn = backend.decode_rope(qkv, step.cos, step.sin, step.slot_mapping, k_cache, v_cache, step.block_tables,
                                   step.seq_lens, scale, num_heads, qk_norm=qk_norm, quant=quant, **window)
        if is_quantized(attn):  # [B, H D] quantised
            return attn
    else:
        q = rope_kv(qkv, step.cos, step.sin, step.slot_mapping, k_cache, v_cache, num_heads, num_kv_heads,
                    qk_norm=qk_norm, use_triton=step.use_triton, rotate_fp32=rotate_fp32)  # [B, H, D]
        attn = backend.decode(q, k_cache, v_cache, step.block_tables, step.seq_lens, scale, step.use_triton,
                              step.max_seq_len, **window)  # [B, H, D]
    return attn.reshape(qkv.shape[0], -1)


@dataclass
class GatedMLP:
    """down(act(gate(h)) * up(h)) with gate and up as one GEMM; act: "silu" or "gelu_tanh". The weights are
    plain or quantised (quant/linear.py), both through `linear`; with `fusion` the activation kernel quantises the
    down GEMM's input where that GEMM wants it so, and the down output may be split-K partials."""

    gate_up_weight: LinearWeight  # [2 I, E], the gate rows then the up rows
    down_weight: LinearWeight  # [E, I]
    activation: str = "silu"
    linear: Linear = field(kw_only=True)  # the decoder's GEMM (required: a default would bypass its choice)
    # the decoder's quantised GEMMs' hand-offs (quant/fusion.py), where only blocks.add_norm reads the output
    fusion: HandOffs | None = field(default=None, kw_only=True)

    def input_quant(self, like: torch.Tensor) -> InputQuant | None:
        """How the gate/up GEMM wants h (like's rows, dtype, device) quantised by the kernel writing it, or None."""
        return None if self.fusion is None else self.fusion.input_quant(self.gate_up_weight, like)

    def __call__(self, h: LinearInput, use_triton: bool) -> LinearOutput:
        """h: [B, E] (as input_quant asked) -> [B, E] (with `fusion`: as its linear_to_norm leaves it)."""
        gate_up = self.linear(h, self.gate_up_weight, None)  # [B, 2 I]
        if self.fusion is None:
            return self.linear(gated_act(gate_up, self.activation, use_triton=use_triton), self.down_weight, None)
        quant = self.fusion.input_quant(self.down_weight, gate_up)
        gated = gated_act(gate_up, self.activation, use_triton=use_triton, quant=quant)  # [B, I]
        return self.fusion.linear_to_norm(gated, self.down_weight, None)


def mlp_input_quant(mlp: object, like: torch.Tensor) -> InputQuant | None:
    """How a layer's MLP wants its input quantised by the norm writing it: a GatedMLP's gate/up GEMM's wish
    (GatedMLP.input_quant); PlainMLP and the MoE blocks take it as a tensor (None)."""
    return mlp.input_quant(like) if isinstance(mlp, GatedMLP) else None


@dataclass
class PlainMLP:
    """proj(act(fc(h))), the non-gated MLP with biases (Starcoder2's c_fc/c_proj), in torch's own ops: those of
    the eager module, so every device rounds as it does (the two GEMMs dominate). act: "gelu_tanh" or "gelu"."""

    fc_weight: LinearWeight  # [I, E]
    fc_bias: torch.Tensor | None  # [I]
    proj_weight: LinearWeight  # [E, I]
    proj_bias: torch.Tensor | None  # [E]
    activation: str = "gelu_tanh"
    linear: Linear = field(kw_only=True)  # the decoder's GEMM (required: a default would bypass its choice)

    def __post_init__(self) -> None:
        assert self.activation in PLAIN_ACTIVATIONS

    def __call__(self, h: torch.Tensor, use_triton: bool) -> torch.Tensor:
        """h: [B, E] -> [B, E]."""
        act = PLAIN_ACTIVATIONS[self.activation](self.linear(h, self.fc_weight, self.fc_bias))  # [B, I]
        return self.linear(act, self.proj_weight, self.proj_bias)

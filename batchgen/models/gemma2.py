"""Fused decode and packed forwards of Gemma2 and Gemma3 (text) over the transformers model's weights.

Both keep Gemma's (1 + w) RMSNorm in fp32 (blocks.Norm "rms_unit_offset"), its self-scaling embedding and its
GELU-tanh gated MLP, and add, per layer, a norm after each sublayer before its residual add (sandwich norms):

    h = input_layernorm(x);             x <- x + post_attention_layernorm(attn(h))
    h = pre_feedforward_layernorm(x);   x <- x + post_feedforward_layernorm(mlp(h))

Layers alternate sliding-window attention (`sliding_window` tokens, as transformers' masks: a query at position p
sees keys after p - window) with global attention (config.layer_types); the decode and prefill kernels bound
their reads to the window, so K/V outside it are never read. The softmax scale is query_pre_attn_scalar ** -0.5.
Gemma2 soft-caps the attention scores (attn_logit_softcapping) and the logits (final_logit_softcapping);
Gemma3 normalises q and k per head before the rotary (its own (1 + w) RMSNorm, kernels/attention/rope_kv.py's QKNorm: on a
decode step inside the fused rotary + K/V write + attention kernel, kernels/attention/paged_decode.py, as Gemma2's rotary;
on packed steps inside the rotary + K/V write kernel) and rotates sliding and global layers with their own rotary
tables (local base 10k, global base 1M with linear scaling), which transformers' rotary module makes per layer
type. Gemma3's multimodal model (model type "gemma3") and its bidirectional variant are not covered.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from batchgen.models.blocks import GatedMLP, Norm, add_norm, attend_qkv
from batchgen.quant.linear import LinearWeight, linear_weight
from batchgen.quant.fusion import input_quant, linear_to_norm
from batchgen.models.gemma import ACTIVATIONS
from batchgen.kernels.attention.rope_kv import QKNorm
from batchgen.models.llama import LlamaDecoder, module_reason, qk_norm

MODEL_TYPES = ("gemma2", "gemma3_text")


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this Gemma2 / Gemma3 text model cannot use the fused forward, or None when it can."""
    cfg = model.config.get_text_config()
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    reason = module_reason(model)
    if reason is not None:
        return reason
    layer = model.model.layers[0]
    if not hasattr(layer, "pre_feedforward_layernorm") or not hasattr(layer, "post_feedforward_layernorm"):
        return "layers without Gemma2's pre/post feed-forward norms"
    if not hasattr(model.model.embed_tokens, "embed_scale"):  # the decoder relies on the module scaling itself
        return "the embedding module does not apply Gemma's scale itself"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    return _rope_reason(model)


def _rope_reason(model: torch.nn.Module) -> str | None:
    """Why the rotary tables are not static per position, or not over the whole head, or None."""
    rotary, cfg = model.model.rotary_emb, model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    types = _layer_types(model) if _per_layer_type(rotary) else [None]
    for t in types:
        rope_type = rotary.rope_type[t] if t is not None else getattr(rotary, "rope_type", "default")
        if "dynamic" in rope_type or rope_type == "longrope":
            return f"rope type {rope_type!r} (depends on the sequence length)"
        inv_freq = getattr(rotary, f"{t}_inv_freq" if t is not None else "inv_freq", None)
        if inv_freq is not None and 2 * inv_freq.numel() != head_dim:
            return f"partial rotary ({2 * inv_freq.numel()} of {head_dim} head dims)"
    if hasattr(model.model.layers[0].self_attn, "q_norm") and not _per_layer_type(rotary):
        return "Gemma3's rotary module takes no layer type (an older transformers)"
    return None


def _per_layer_type(rotary: torch.nn.Module) -> bool:
    """Whether transformers' rotary module makes its tables per layer type (Gemma3: forward(x, pos, layer_type))."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


def _layer_types(model: torch.nn.Module) -> list[str]:
    cfg = model.config.get_text_config()
    return list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)


@dataclass
class Gemma2Layer:
    """One Gemma2 / Gemma3 layer's weights, views of the model's own (q/k/v rebound into one tensor)."""

    input_norm: Norm  # [E]
    qkv_weight: LinearWeight  # [(H + 2 Hkv) D, E]
    o_weight: LinearWeight  # [E, H D]
    post_attention_norm: Norm  # [E]
    pre_mlp_norm: Norm  # [E]
    mlp: GatedMLP
    post_mlp_norm: Norm  # [E]
    scale: float  # query_pre_attn_scalar ** -0.5
    layer_type: str  # "sliding_attention" | "full_attention": which rotary table and window
    sliding_window: int | None  # tokens a query sees on a sliding layer; None on global layers
    softcap: float | None  # Gemma2's attention soft-capping
    qk_norm: QKNorm | None  # Gemma3: per-head norms of q and k ((1 + w) rounding), inside the rotary kernels


class Gemma2Decoder(LlamaDecoder):
    model_types = MODEL_TYPES
    unsupported_reason = staticmethod(unsupported_reason)

    norm_kind = "rms_unit_offset"
    activation = "gelu_tanh"

    def __init__(self, model: torch.nn.Module, kv_cache, use_triton: bool, shard=None,
                 deterministic: bool = False, fp8_gemm: str = "auto") -> None:
        self._types = _layer_types(model)
        super().__init__(model, kv_cache, use_triton, shard, deterministic, fp8_gemm)
        self.per_type_rotary = _per_layer_type(self.rotary)
        self.final_softcap = getattr(self.config, "final_logit_softcapping", None)

    def _layer(self, layer: torch.nn.Module) -> Gemma2Layer:
        attn = layer.self_attn
        qkv_w, qkv_b = self._qkv(attn)
        assert qkv_b is None and attn.o_proj.bias is None, "Gemma's projections have no biases"
        layer_type = self._types[attn.layer_idx] if hasattr(attn, "layer_idx") else "full_attention"
        return Gemma2Layer(
            input_norm=self._norm(layer.input_layernorm), qkv_weight=qkv_w, o_weight=linear_weight(attn.o_proj),
            post_attention_norm=self._norm(layer.post_attention_layernorm),
            pre_mlp_norm=self._norm(layer.pre_feedforward_layernorm), mlp=self._mlp(layer.mlp),
            post_mlp_norm=self._norm(layer.post_feedforward_layernorm), scale=attn.scaling, layer_type=layer_type,
            sliding_window=getattr(attn, "sliding_window", None),
            # Gemma3's attention module keeps the config's attn_logit_softcapping but never applies it
            softcap=getattr(attn, "attn_logit_softcapping", None) if self.config.model_type == "gemma2" else None,
            qk_norm=qk_norm(attn, unit_offset=True) if hasattr(attn, "q_norm") else None)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self._head(h)  # [S, V]
        if self.final_softcap is not None:  # as transformers rounds it: three ops in the logits' dtype
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, make_step) -> torch.Tensor:
        tri, geo = self.use_triton, self.geometry
        residual = self._embed(input_ids)  # [B, E], scaled by the module; updated in place below
        types = dict.fromkeys(layer.layer_type for layer in self.layers)
        if self.per_type_rotary:  # layer type -> StepInputs with that type's rotary tables ([1, B, D] each)
            tables = {t: self.rotary(residual, positions[None], t) for t in types}
            steps = {t: make_step(cos[0].contiguous(), sin[0].contiguous()) for t, (cos, sin) in tables.items()}
        else:
            shared = make_step(*self._cos_sin(residual, positions))
            steps = {t: shared for t in types}
        h = add_norm(residual, self.layers[0].input_norm, None, tri,
                     quant=input_quant(self.fusion, self.layers[0].qkv_weight, residual))
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = self.kv_cache.layer(i)
            qkv = self.linear(h, layer.qkv_weight, None)  # [B, (H + 2 Hkv) D]
            attn = attend_qkv(qkv, k_cache, v_cache, steps[layer.layer_type], geo.num_heads, geo.num_kv_heads,
                              layer.scale, layer.qk_norm, sliding_window=layer.sliding_window,
                              softcap=layer.softcap)  # [B, H D]
            o = linear_to_norm(self.fusion, self.linear, attn, layer.o_weight, None)
            o = add_norm(self._reduce(o), layer.post_attention_norm, None, tri)
            # residual <- residual + o, then its norm
            h = add_norm(o, layer.pre_mlp_norm, residual, tri, quant=layer.mlp.input_quant(residual))
            mlp = add_norm(self._reduce(layer.mlp(h, tri)), layer.post_mlp_norm, None, tri)
            norm, quant = self._next_norm(i, residual)
            h = add_norm(mlp, norm, residual, tri, quant=quant)
        return h

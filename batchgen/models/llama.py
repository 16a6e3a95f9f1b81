"""Fused decode forward of the Llama family (Llama, Mistral, Qwen2, Qwen3) over the transformers model's weights.

transformers' eager modules launch ~45 kernels per layer in a decode step, and cuBLAS runs the small q, k
and v projections far below the memory bandwidth (at 32 rows, a 1024x4096 bf16 GEMM reads its weight at
~0.3 TB/s on an H200, while one 6144x4096 GEMM reads q+k+v at ~2.1 TB/s). Per layer this runs 7 kernels:

    add+RMSNorm -> QKV GEMM -> rotary + K/V cache write + decode attention -> o GEMM
    -> add+RMSNorm -> gate/up GEMM -> SiLU*up -> down GEMM

(plus a merge kernel when the batch is too small for one attention split per (sequence, KV head), and a
separate rotary kernel for Qwen3, whose q/k RMSNorm runs there). Prefill and mixed steps (`forward_packed`)
run the same layers over every token, with the rotary + K/V write kernel and the prefill attention kernel
(decode kernel for the step's decode rows). On CPU, and wherever Triton is absent, every
kernel has a torch reference with the same rounding, so CI runs this exact code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.attention.kv_cache import KVCache, KVGeometry
from batchgen.models.base import DecodeForward
from batchgen.attention.backend import AttentionMetadata
from batchgen.models.blocks import StepInputs, add_rmsnorm, gated_mlp, self_attention
from batchgen.models.weights import fuse_linears

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this Llama-family model cannot use the fused decoder, or None when it can."""
    cfg = model.config.get_text_config()
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    return layout_reason(model, max_model_len)


def layout_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why a model with the Llama layer layout (pre-norm layers of q/k/v/o attention and a gated MLP) cannot
    run the fused layers, whatever its norm and activation: module layout, MLP biases, rope type, windows."""
    cfg = model.config.get_text_config()
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} is not a causal LM with model.layers and lm_head"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    norm = getattr(inner.layers[0], "input_layernorm", None) if len(inner.layers) else None
    if norm is None or not (hasattr(norm, "variance_epsilon") or hasattr(norm, "eps")):
        return "layers without an RMSNorm input_layernorm (variance_epsilon or eps)"
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        return f"rope type {rope_type!r} (depends on the sequence length)"
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    slides = window is not None and (layer_types is None or "sliding_attention" in layer_types)
    if getattr(cfg, "use_sliding_window", True) is False:  # Qwen2/Qwen3 configs carry a window they do not use
        slides = False
    if slides and window < max_model_len:
        return f"sliding window {window} < max_model_len {max_model_len}"
    return None


def norm_eps(norm: torch.nn.Module) -> float:
    """An RMSNorm module's epsilon (Llama-style modules call it variance_epsilon, Gemma's eps)."""
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [E]
    input_eps: float
    qkv_weight: torch.Tensor  # [(H + 2 Hkv) D, E], a view of the model's q/k/v weights
    qkv_bias: torch.Tensor | None  # [(H + 2 Hkv) D] (Qwen2)
    o_weight: torch.Tensor  # [E, H D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [E]
    post_eps: float
    gate_up_weight: torch.Tensor  # [2 I, E], a view of the model's gate/up weights
    down_weight: torch.Tensor  # [E, I]
    scale: float
    qk_norm: tuple[torch.Tensor, float] | None  # Qwen3: per-head q/k RMSNorm weights [2, D] (q, k), eps


class LlamaDecoder(DecodeForward):
    is_fused = True
    has_packed = True
    norm_unit_offset = False  # Gemma: RMSNorm weights are offsets from 1
    activation = "silu"  # the MLP gate's activation (kernels/gated_act.py)

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, use_triton: bool) -> None:
        cfg = model.config.get_text_config()
        inner = model.model
        self.name = "fused"
        self.kv_cache = kv_cache
        self.use_triton = use_triton
        self.geometry = KVGeometry.from_config(cfg)
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.final_norm, self.final_eps = inner.norm.weight, norm_eps(inner.norm)
        self.lm_head = model.lm_head
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                attn, mlp = layer.self_attn, layer.mlp
                qkv_w, qkv_b = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
                gate_up_w, _ = fuse_linears([mlp.gate_proj, mlp.up_proj])
                self.layers.append(_Layer(
                    input_norm=layer.input_layernorm.weight, input_eps=norm_eps(layer.input_layernorm),
                    qkv_weight=qkv_w, qkv_bias=qkv_b, o_weight=attn.o_proj.weight, o_bias=attn.o_proj.bias,
                    post_norm=layer.post_attention_layernorm.weight,
                    post_eps=norm_eps(layer.post_attention_layernorm),
                    gate_up_weight=gate_up_w, down_weight=mlp.down_proj.weight,
                    scale=getattr(attn, "scaling", self.geometry.head_dim ** -0.5),
                    # a [2, D] copy (the q row, then the k row) so one kernel pointer reaches both
                    qk_norm=(torch.stack([attn.q_norm.weight, attn.k_norm.weight]).detach(),
                             norm_eps(attn.q_norm)) if hasattr(attn, "q_norm") else None))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int | None = None) -> torch.Tensor:
        h = self._hidden(input_ids, positions, lambda cos, sin: StepInputs(
            positions, slot_mapping, block_tables, seq_lens, cos, sin, self.use_triton, max_seq_len))
        return self.lm_head(h)  # [B, V]

    @torch.inference_mode()
    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       logits_index: torch.Tensor) -> torch.Tensor:
        h = self._hidden(input_ids, positions, lambda cos, sin: StepInputs(
            positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, cos, sin, self.use_triton,
            meta.max_seq_len, packed=meta))
        return self.lm_head(h[logits_index])  # [S, V]

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, make_step) -> torch.Tensor:
        """The final-normed hidden states [B, E] of every row; `make_step(cos, sin)` builds the StepInputs."""
        tri, geo = self.use_triton, self.geometry
        residual = self.embed(input_ids)  # [B, E]; a fresh tensor, updated in place below
        cos, sin = self.rotary(residual, positions[None])  # [1, B, D] each, in the activation dtype
        step = make_step(cos[0].contiguous(), sin[0].contiguous())
        first, unit = self.layers[0], self.norm_unit_offset
        h = add_rmsnorm(residual, first.input_norm, first.input_eps, None, tri, unit)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = self.kv_cache.layer(i)
            o = self_attention(h, layer.qkv_weight, layer.qkv_bias, layer.o_weight, layer.o_bias, k_cache, v_cache,
                               step, geo.num_heads, geo.num_kv_heads, layer.scale, layer.qk_norm)
            h = add_rmsnorm(o, layer.post_norm, layer.post_eps, residual, tri, unit)
            mlp = gated_mlp(h, layer.gate_up_weight, layer.down_weight, tri, self.activation)
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            norm, eps = (nxt.input_norm, nxt.input_eps) if nxt is not None else (self.final_norm, self.final_eps)
            h = add_rmsnorm(mlp, norm, eps, residual, tri, unit)
        return h

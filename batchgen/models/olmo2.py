"""Fused decode and packed forwards of OLMo2 over the transformers model's weights.

OLMo2's layer order is not Llama's pre-norm one: the residual stream goes into attention and the MLP as it
is, and each sublayer's output is normalised before it is added back (post-norms):

    x <- x + post_attention_layernorm(attn(x))
    x <- x + post_feedforward_layernorm(mlp(x))            (then the final norm after the last layer)

Inside attention, q and k are RMS-normalised over the whole projection (q_norm over H * D, k_norm over Hkv * D,
not per head as Qwen3's), before the rotary. Rounding as transformers' modules: every OLMo2 RMSNorm multiplies
its weight in fp32 and rounds once (blocks.Norm "rms_fp32_weight"), and the rotary tables stay fp32, so the
rotation is taken in fp32 and rounded once (rope_kv's rotate_fp32; that keeps the rotary out of the decode
attention kernel). Per layer: QKV GEMM -> q/k norms in place in the QKV output -> rotary + K/V write ->
attention -> o GEMM -> norm, add -> gate/up GEMM -> SiLU*up -> down GEMM -> norm, add.

Tensor parallelism: a rank holds H / N query heads and Hkv / N KV heads, and the matching slices of the q/k norm
weights (models/shard.py shard_model_), so the norm's mean of squares spans the ranks: each rank sums its
columns' squares in fp32, the sums are added over the ranks (one all-reduce of [B, 2] a layer), and each rank
normalises its own columns (`_sharded_qk_norm`). The post-norms act on whole rows after the sums over ranks, as
the Llama layers' norms do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.models.blocks import GatedMLP, Norm, add_norm, attend_qkv
from batchgen.quant.linear import LinearWeight, linear_weight
from batchgen.quant.fusion import linear_to_norm
from batchgen.models.llama import LlamaDecoder, fused_groups_reason, rope_reason, window_reason

MODEL_TYPES = ("olmo2",)


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this OLMo2 model cannot use the fused forward, or None when it can."""
    cfg = model.config.get_text_config()
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    inner = getattr(model, "model", None)
    if inner is None or not getattr(inner, "layers", None) or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} is not a causal LM with model.layers and lm_head"
    layer = inner.layers[0]
    if not hasattr(layer, "post_feedforward_layernorm") or not hasattr(layer.self_attn, "q_norm"):
        return "layers without OLMo2's post-norms and q/k norms"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    return rope_reason(model) or window_reason(model, max_model_len) or fused_groups_reason(model.model.layers)


@dataclass
class Olmo2Layer:
    """One OLMo2 layer's weights, views of the model's own (the q/k/v projections rebound into one tensor)."""

    qkv_weight: LinearWeight  # [(H + 2 Hkv) D, E]
    qkv_bias: torch.Tensor | None  # [(H + 2 Hkv) D]
    q_norm: Norm  # [H D]: over the whole projected q
    k_norm: Norm  # [Hkv D]
    o_weight: LinearWeight  # [E, H D]
    o_bias: torch.Tensor | None  # [E]
    post_attention_norm: Norm  # [E]
    mlp: GatedMLP
    post_mlp_norm: Norm  # [E]
    scale: float


class Olmo2Decoder(LlamaDecoder):
    model_types = MODEL_TYPES
    unsupported_reason = staticmethod(unsupported_reason)

    norm_kind = "rms_fp32_weight"

    def _layer(self, layer: torch.nn.Module) -> Olmo2Layer:
        attn = layer.self_attn
        qkv_w, qkv_b = self._qkv(attn)
        return Olmo2Layer(qkv_weight=qkv_w, qkv_bias=qkv_b, q_norm=self._norm(attn.q_norm),
                          k_norm=self._norm(attn.k_norm), o_weight=linear_weight(attn.o_proj), o_bias=attn.o_proj.bias,
                          post_attention_norm=self._norm(layer.post_attention_layernorm), mlp=self._mlp(layer.mlp),
                          post_mlp_norm=self._norm(layer.post_feedforward_layernorm),
                          scale=getattr(attn, "scaling", self.geometry.head_dim ** -0.5))

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, make_step) -> torch.Tensor:
        tri, geo = self.use_triton, self.geometry
        q_cols, k_cols = geo.num_heads * geo.head_dim, geo.num_kv_heads * geo.head_dim
        residual = self._embed(input_ids)  # [B, E]; updated in place below
        step = make_step(*self._cos_sin(residual, positions))  # fp32 tables, as OLMo2's rotary module makes them
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = self.kv_cache.layer(i)
            qkv = self.linear(residual, layer.qkv_weight, layer.qkv_bias)  # [B, (H + 2 Hkv) D]
            q, k = qkv[:, :q_cols], qkv[:, q_cols:q_cols + k_cols]  # [B, H D], [B, Hkv D]: strided views
            if self.shard is None:
                add_norm(q, layer.q_norm, None, tri, out=q)  # in place: each row is read whole before it is written
                add_norm(k, layer.k_norm, None, tri, out=k)
            else:
                self._sharded_qk_norm(q, k, layer)
            attn = attend_qkv(qkv, k_cache, v_cache, step, geo.num_heads, geo.num_kv_heads, layer.scale,
                              rotate_fp32=True)  # [B, H D]
            o = linear_to_norm(self.fusion, self.linear, attn, layer.o_weight, layer.o_bias)  # [B, E]
            residual.add_(add_norm(self._reduce(o), layer.post_attention_norm, None, tri))
            mlp = layer.mlp(residual, tri)  # [B, E]
            residual.add_(add_norm(self._reduce(mlp), layer.post_mlp_norm, None, tri))
        return add_norm(residual, self.final_norm, None, tri)

    def _sharded_qk_norm(self, q: torch.Tensor, k: torch.Tensor, layer: Olmo2Layer) -> None:
        """OLMo2's q and k norms over the whole projection when this rank holds 1/N of its columns: q [B, H D / N]
        and k [B, Hkv D / N] (views into the QKV output) normalised in place, rounded as the unsplit norm
        (rms_fp32_weight: fp32 throughout, the weight multiplied in fp32, rounded once)."""
        sums = torch.stack([q.float().square().sum(-1), k.float().square().sum(-1)], dim=1)  # [B, 2] fp32
        sums = self._reduce(sums)  # every rank's columns
        for x, norm, col in ((q, layer.q_norm, 0), (k, layer.k_norm, 1)):
            variance = sums[:, col:col + 1] / (x.shape[1] * self.shard.size)  # [B, 1]
            x.copy_((norm.weight.float() * (x.float() * torch.rsqrt(variance + norm.eps))).to(x.dtype))

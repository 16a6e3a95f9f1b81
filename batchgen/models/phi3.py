"""Fused decode and packed forwards of Phi-3 (and Phi-3.5 / Phi-4-mini checkpoints of model type phi3).

Phi-3 has the Llama layer order, RMSNorm rounding and SiLU gate; what differs is its checkpoint layout and its
rope. q/k/v are one `qkv_proj` Linear ([(H + 2 Hkv) D, E]: q rows, then k, then v) and gate/up one
`gate_up_proj` ([2 I, E]: gate rows, then up), which are exactly the fused layouts our layers read: the
decoder takes those weights as they are, with no copy and no rebinding.

Rope: the default rope runs as Llama's (transformers' rotary module per step, fused into the attention kernel
on CUDA). LongRoPE ("longrope", formerly "su") picks its frequencies by the longest position in a forward call:
the short factors while it is <= original_max_position_embeddings, the long ones beyond. Within that bound it
is a static table, so when max_model_len <= original_max_position_embeddings (every sequence stays inside it)
the decoder precomputes cos/sin of every position once, through transformers' own module, and indexes it per
token: exact, graph-capturable (no host sync, no in-place frequency switch). Beyond it the choice would depend
on how a step is batched, so such models fall back, with that reason. Partial rotary (Phi-4-mini rotates 3/4
of each head) falls back too.
"""

from __future__ import annotations

import torch

from batchgen.attention.kv_cache import KVCache
from batchgen.models.blocks import GatedMLP
from batchgen.quant.linear import linear_weight
from batchgen.models.llama import LlamaDecoder, module_reason, partial_rotary_reason, rope_reason

MODEL_TYPES = ("phi3",)


def original_max_positions(cfg) -> int | None:
    """LongRoPE's original_max_position_embeddings (rope_parameters in transformers 5, else the config's)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return params.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this Phi-3 model cannot use the fused forward, or None when it can."""
    cfg = model.config.get_text_config()
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    reason = module_reason(model)
    if reason is not None:
        return reason
    layer = model.model.layers[0]
    if not hasattr(layer.self_attn, "qkv_proj") or not hasattr(layer.mlp, "gate_up_proj"):
        return "layers without Phi-3's qkv_proj and gate_up_proj"
    rotary = model.model.rotary_emb
    if getattr(rotary, "rope_type", "default") == "longrope":
        original = original_max_positions(cfg)
        if original is None or max_model_len > original:
            return (f"rope type 'longrope' with max_model_len {max_model_len} > original_max_position_embeddings "
                    f"{original} (its frequencies switch with the sequence length)")
        reason = partial_rotary_reason(model)
    else:
        reason = rope_reason(model)
    return reason


class Phi3Decoder(LlamaDecoder):
    model_types = MODEL_TYPES
    unsupported_reason = staticmethod(unsupported_reason)

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, use_triton: bool, shard=None,
                 deterministic: bool = False, fp8_gemm: str = "auto") -> None:
        super().__init__(model, kv_cache, use_triton, shard, deterministic, fp8_gemm)
        self.cos_table = self.sin_table = None  # [L, D] each: LongRoPE's short-factor rotary of positions < L
        if getattr(self.rotary, "rope_type", "default") == "longrope":
            num_positions = original_max_positions(self.config)  # >= max_model_len (unsupported_reason)
            weight = self.embed.weight
            with torch.no_grad():
                positions = torch.arange(num_positions, device=weight.device)[None]  # [1, L]
                cos, sin = self.rotary(weight[:1], positions)  # max position + 1 = L: the short factors
            self.cos_table, self.sin_table = cos[0].contiguous(), sin[0].contiguous()

    def _qkv(self, attn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        return linear_weight(attn.qkv_proj), attn.qkv_proj.bias  # already [(H + 2 Hkv) D, E], q then k then v

    def _mlp(self, mlp: torch.nn.Module) -> GatedMLP:
        # gate_up_proj: [2 I, E], the gate rows then the up rows
        return GatedMLP(linear_weight(mlp.gate_up_proj), linear_weight(mlp.down_proj), self.activation,
                        linear=self.linear, fusion=self.fusion)

    def _cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos_table is None:
            return super()._cos_sin(x, positions)
        return self.cos_table[positions], self.sin_table[positions]  # [B, D] each, fresh and contiguous

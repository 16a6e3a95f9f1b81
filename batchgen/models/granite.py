"""Fused decode and packed forwards of Granite (IBM's dense Granite 3.x) over the transformers model's weights.

Granite is the Llama layer layout with four scalar multipliers from its config, each applied where
transformers' modules apply it and rounded the same way:

    embedding_multiplier   the embedding is multiplied by it before the first layer
    residual_multiplier    each sublayer's output is multiplied by it, then added to the residual stream
                           (`residual + out * m`: the product rounded, then the sum; inside the fused
                           residual add + RMSNorm kernel, `LlamaDecoder.branch_scale`)
    attention_multiplier   the softmax scale, instead of head_dim ** -0.5 (the attention module's `scaling`,
                           which the Llama decoder already reads)
    logits_scaling         the logits are divided by it (a division, not a product with the reciprocal, so
                           they round as the eager model's)

GraniteMoe and Granite 4 (hybrid Mamba) are other model types.
"""

from __future__ import annotations

import torch

from batchgen.attention.kv_cache import KVCache
from batchgen.models.llama import LlamaDecoder, layout_reason

MODEL_TYPES = ("granite",)


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this Granite model cannot use the fused forward, or None when it can."""
    cfg = model.config.get_text_config()
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    return layout_reason(model, max_model_len)


class GraniteDecoder(LlamaDecoder):
    model_types = MODEL_TYPES
    unsupported_reason = staticmethod(unsupported_reason)

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, use_triton: bool, shard=None,
                 deterministic: bool = False, fp8_gemm: str = "auto") -> None:
        super().__init__(model, kv_cache, use_triton, shard, deterministic, fp8_gemm)
        self.embedding_multiplier = float(self.config.embedding_multiplier)
        self.branch_scale = float(self.config.residual_multiplier)  # applied inside the add + norm kernel
        self.logits_scaling = float(self.config.logits_scaling)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids) * self.embedding_multiplier  # [B, E]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._head(h) / self.logits_scaling  # [S, V]

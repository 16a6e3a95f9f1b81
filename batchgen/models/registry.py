"""Which decode forward a model runs: a fused decoder registered for its model type, or transformers' modules
with our attention, with the reason printed at start-up. A new architecture is a file in this folder whose
decoder class is added to DECODERS under its transformers `model_type`."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from batchgen.attention.kv_cache import KVCache
from batchgen.models import gemma, gemma2, granite, llama, mixtral, olmo2, phi3, qwen_moe, starcoder2
from batchgen.models.base import DecodeForward
from batchgen.models.transformers_forward import TransformersDecode

# model_type -> (why a model of that type cannot be fused, or None; the decoder class)
DECODERS: dict[str, tuple[Callable[[torch.nn.Module, int], str | None], type[DecodeForward]]] = {
    **{t: (llama.unsupported_reason, llama.LlamaDecoder) for t in llama.MODEL_TYPES},
    **{t: (gemma.unsupported_reason, gemma.GemmaDecoder) for t in gemma.MODEL_TYPES},
    **{t: (gemma2.unsupported_reason, gemma2.Gemma2Decoder) for t in gemma2.MODEL_TYPES},
    **{t: (phi3.unsupported_reason, phi3.Phi3Decoder) for t in phi3.MODEL_TYPES},
    **{t: (olmo2.unsupported_reason, olmo2.Olmo2Decoder) for t in olmo2.MODEL_TYPES},
    **{t: (granite.unsupported_reason, granite.GraniteDecoder) for t in granite.MODEL_TYPES},
    **{t: (starcoder2.unsupported_reason, starcoder2.Starcoder2Decoder) for t in starcoder2.MODEL_TYPES},
    **{t: (qwen_moe.unsupported_reason, qwen_moe.QwenMoEDecoder) for t in qwen_moe.MODEL_TYPES},
    **{t: (mixtral.unsupported_reason, mixtral.MixtralDecoder) for t in mixtral.MODEL_TYPES},
}


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this model has no fused decode forward, or None when it has one."""
    model_type = model.config.get_text_config().model_type
    if model_type not in DECODERS:
        return f"model type {model_type!r} (fused decoders: {', '.join(sorted(DECODERS))})"
    return DECODERS[model_type][0](model, max_model_len)


def build_decode_forward(model: torch.nn.Module, kv_cache: KVCache, use_triton: bool, max_model_len: int,
                         fused_decoder: bool = True, compile: bool = False) -> DecodeForward:
    """The decode forward for this model. A fused decoder that fails its first step on the device warns and
    falls back to transformers' modules."""
    reason = "off" if not fused_decoder else "compile requested" if compile else \
        unsupported_reason(model, max_model_len)
    if reason is None:
        fused = DECODERS[model.config.get_text_config().model_type][1](model, kv_cache, use_triton)
        reason = fused.check(kv_cache)
        if reason is None:
            return fused
        warnings.warn(f"batchgen: {reason}; decode steps use transformers' modules", stacklevel=3)
    return TransformersDecode(model, kv_cache, use_triton, max_model_len, reason)

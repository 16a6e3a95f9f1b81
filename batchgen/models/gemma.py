"""Fused decode and packed forwards of Gemma (the first generation) over the transformers model's weights.

Gemma has the Llama layer order (pre-norm attention and gated MLP, rotary, GQA), so it runs the Llama family's
fused layers with two differences, both in the shared kernels: its RMSNorm stores the weight as an offset from 1
and multiplies in fp32 before rounding once (`kernels/norm/rmsnorm.py`, unit_offset), and its MLP gate is the
tanh-approximated GELU (`kernels/norm/gated_act.py`). The embedding's sqrt(hidden) scale is applied by transformers'
own embedding module, which the decoder calls; the attention scale is the module's (head_dim ** -0.5).
Gemma2 and Gemma3 (soft-capping, alternating sliding windows, post-norms) are other files' work.
"""

from __future__ import annotations

import torch

from batchgen.models.llama import LlamaDecoder, layout_reason

MODEL_TYPES = ("gemma",)
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}  # transformers' name -> gated_act's


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this Gemma model cannot use the fused forward, or None when it can."""
    cfg = model.config.get_text_config()
    act = getattr(cfg, "hidden_act", None)  # what transformers' GemmaMLP applies
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not hasattr(embed, "embed_scale"):  # the decoder calls the module and relies on it applying sqrt(E)
        return "the embedding module does not apply Gemma's scale itself"
    return layout_reason(model, max_model_len)


class GemmaDecoder(LlamaDecoder):
    model_types = MODEL_TYPES
    unsupported_reason = staticmethod(unsupported_reason)

    norm_kind = "rms_unit_offset"
    activation = "gelu_tanh"

"""Fused decode and packed forwards of Mixtral (SparseMoE blocks on the Mistral layers).

Attention is Mistral's: no biases, and a config `sliding_window` shorter than max_model_len falls back to
transformers' modules with that reason (the fused layers attend to the whole context), as Mistral's does. The
router (MixtralTopKRouter) takes the softmax of the logits in fp32, the top-k of the probabilities and always
renormalises them (the same as a softmax over the top-k logits, rounded as transformers computes it), and keeps
the routing weights in fp32: each expert's down output (rounded to the activation dtype) times its weight is an
fp32 product, summed over k in fp32 and rounded once, as transformers' experts forward promotes it.
"""

from __future__ import annotations

import torch

from batchgen.models.moe import MoEDecoder, moe_reason

MODEL_TYPES = ("mixtral",)


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this Mixtral model cannot use the fused forward, or None when it can."""
    return moe_reason(model, max_model_len)


class MixtralDecoder(MoEDecoder):
    model_types = MODEL_TYPES
    unsupported_reason = staticmethod(unsupported_reason)

    weights_fp32 = True

    def _renormalize(self) -> bool:
        return True

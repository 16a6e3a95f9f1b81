"""Fused decode and packed forwards of Starcoder2 over the transformers model's weights.

Starcoder2 keeps the pre-norm layer order of Llama but with GPT-style pieces: LayerNorm with weight and bias
(`norm_epsilon`) instead of RMSNorm, biases on q/k/v/o, and a non-gated MLP c_fc -> GELU (tanh approximation,
`gelu_pytorch_tanh`) -> c_proj with biases. Each residual add and the LayerNorm after it are one kernel
(blocks.Norm "layer", kernels/norm/layernorm.py: on CUDA the Triton kernel, rounding once from fp32 as torch's
layer_norm does, its sums in its own order; on CPU torch's own add and layer_norm, the eager module's bits); the
MLP runs torch's linear/GELU (blocks.PlainMLP), the eager module's ops; the attention is the shared fused path
(QKV GEMM with the fused bias, rotary + K/V write + paged attention). A config `sliding_window` is passed to the
kernels on every layer, as Mistral's.
"""

from __future__ import annotations

import torch

from batchgen.models.blocks import Norm, PlainMLP
from batchgen.quant.linear import linear_weight
from batchgen.models.llama import LlamaDecoder, module_reason, norm_eps, rope_reason

MODEL_TYPES = ("starcoder2",)
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}  # transformers' name -> blocks.PlainMLP's


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this Starcoder2 model cannot use the fused forward, or None when it can."""
    cfg = model.config.get_text_config()
    act = getattr(cfg, "hidden_act", None)
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    reason = module_reason(model)
    if reason is not None:
        return reason
    layer = model.model.layers[0]
    if not isinstance(layer.input_layernorm, torch.nn.LayerNorm) or not hasattr(layer.mlp, "c_fc"):
        return "layers without Starcoder2's LayerNorm and c_fc/c_proj MLP"
    return rope_reason(model)


class Starcoder2Decoder(LlamaDecoder):
    model_types = MODEL_TYPES
    unsupported_reason = staticmethod(unsupported_reason)

    norm_kind = "layer"

    def _norm(self, module: torch.nn.Module) -> Norm:
        return Norm(module.weight, norm_eps(module), "layer", module.bias)  # [E] each

    def _mlp(self, mlp: torch.nn.Module) -> PlainMLP:
        return PlainMLP(linear_weight(mlp.c_fc), mlp.c_fc.bias, linear_weight(mlp.c_proj), mlp.c_proj.bias,
                        ACTIVATIONS[self.config.hidden_act], linear=self.linear)

"""Fused decode and packed forwards of Qwen3-MoE and Qwen2-MoE (SparseMoE blocks on the Llama layers).

Attention is the Llama family's: Qwen3-MoE with Qwen3's per-head q/k RMSNorm (read from the attention module),
Qwen2-MoE with biased q/k/v (fused with the weights). The router (Qwen*MoeTopKRouter) takes the softmax in fp32,
the top-k of the probabilities, divides them by their sum only where the config's `norm_topk_prob` says so
(Qwen3-30B-A3B: true; the config default: false), and rounds the routing weights to the activation dtype
before they multiply the experts' output. Qwen2-MoE adds a shared expert on every sparse layer: a dense gated MLP
(`shared_expert`, its gate and up as one GEMM) times sigmoid(`shared_expert_gate`(h)), added after the routed
experts. Dense layers (`mlp_only_layers`, or not a multiple of `decoder_sparse_step`) run the dense MLP.
"""

from __future__ import annotations

import torch

from batchgen.models.blocks import GatedMLP
from batchgen.quant.linear import linear_weight
from batchgen.models.moe import MoEDecoder, SparseMoE, moe_reason
from batchgen.models.weights import fuse_linears

MODEL_TYPES = ("qwen3_moe", "qwen2_moe")


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this Qwen MoE model cannot use the fused forward, or None when it can."""
    reason = moe_reason(model, max_model_len)
    if reason is not None or model.config.get_text_config().model_type != "qwen2_moe":
        return reason
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts") and not (hasattr(layer.mlp, "shared_expert")
                                                  and hasattr(layer.mlp, "shared_expert_gate")):
            return "Qwen2-MoE sparse layers without shared_expert and shared_expert_gate"
    return None


class QwenMoEDecoder(MoEDecoder):
    model_types = MODEL_TYPES
    unsupported_reason = staticmethod(unsupported_reason)

    weights_fp32 = False  # Qwen's router rounds the routing weights to the activation dtype

    def _shared(self, mlp: torch.nn.Module, block: SparseMoE) -> None:
        if not hasattr(mlp, "shared_expert"):
            return  # Qwen3-MoE
        shared = mlp.shared_expert
        gate_up_w, _ = fuse_linears([shared.gate_proj, shared.up_proj])  # [2 Is, H], views of the model's own
        block.shared = GatedMLP(gate_up_w, linear_weight(shared.down_proj), self.activation, linear=self.linear)
        block.shared_gate_weight = mlp.shared_expert_gate.weight  # [1, H]

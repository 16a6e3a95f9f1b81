"""The sparse Mixture-of-Experts MLP block, and the decoder of Llama-layout MoE families built on it.

MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral) keep the Llama layer: pre-norm attention exactly as the Llama-family
blocks run it (Qwen3-MoE's per-head q/k norm, Qwen2-MoE's q/k/v biases, Mixtral's sliding-window rule), then in
place of the dense MLP a sparse block:

    router GEMM [B, E] -> softmax (fp32) -> top-k -> (renormalise) -> routing weights (rounded per family)
    -> experts: grouped gate_up GEMM -> SiLU*up -> grouped down GEMM * weight -> sum over k
       (kernels/moe/experts.py; pairs aligned by expert and the sum over k: kernels/moe/routing.py)
    (+ Qwen2-MoE's shared expert: a dense gated MLP scaled by sigmoid(shared_expert_gate(h)))

Layers that the config keeps dense (`mlp_only_layers`, `decoder_sparse_step`) hold an ordinary GatedMLP: the
decoder reads whichever module transformers built for each layer. Expert weights are transformers 5.x's 3-D
parameters (`experts.gate_up_proj` [E, 2 I, H], `experts.down_proj` [E, H, I]; `is_transposed` layouts as
transposed views), held as they are: no copies. The router is transformers' ops (GEMM, softmax, topk, renormalise,
round) on every device, so routing choices and weights are those of the eager model; every op is of fixed shape
(CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.models.blocks import GatedMLP
from batchgen.quant.linear import LinearWeight, experts_weights
from batchgen.models.llama import LlamaDecoder, layout_reason
from batchgen.kernels.moe.experts import fused_experts
from batchgen.kernels.moe.routing import combine_accumulators


@dataclass
class SparseMoE:
    """One layer's sparse MLP block: the router, the routed experts and an optional shared expert."""

    router_weight: torch.Tensor  # [E, H]
    # [E, 2 I, H]: per expert the gate rows, then the up rows (a view, any strides; quant/linear.py experts_weights)
    gate_up: LinearWeight
    down: LinearWeight  # [E, H, I]
    top_k: int
    renormalize: bool  # divide the top-k probabilities by their sum (norm_topk_prob; always for Mixtral)
    weights_fp32: bool  # routing weights stay fp32 (Mixtral) or are rounded to the activation dtype (Qwen)
    shared: GatedMLP | None = None  # Qwen2-MoE's shared expert
    shared_gate_weight: torch.Tensor | None = None  # [1, H]: its sigmoid gate
    activation: str = "silu"
    routed_counts: torch.Tensor | None = None  # [E] int64: pairs routed to each expert, summed over steps;
    # None: not counted. Graph padding rows are counted too (they route like any row).

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, H] -> (topk_ids [B, K] int64, topk_weights [B, K]) with transformers' routers' ops and roundings:
        logits in the activation dtype (cuBLAS, as transformers), softmax in fp32, top-k of the probabilities,
        renormalised in fp32, rounded to the activation dtype unless weights_fp32."""
        logits = F.linear(h, self.router_weight)  # [B, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [B, E]
        top_w, top_ids = torch.topk(probs, self.top_k, dim=-1)  # [B, K] each
        if self.renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_ids, top_w.to(torch.float32 if self.weights_fp32 else logits.dtype)

    def check_kernels(self, dtype: torch.dtype) -> None:
        """Run the once-per-configuration check of the combine kernel (combine_accumulators) for activations of
        `dtype` now, outside any graph capture (it synchronises with the host)."""
        w_dtype = torch.float32 if self.weights_fp32 else dtype
        combine_accumulators(self.router_weight.device, self.top_k, torch.promote_types(dtype, w_dtype), dtype)

    def __call__(self, h: torch.Tensor, use_triton: bool) -> torch.Tensor:
        """h: [B, H] -> [B, H]."""
        top_ids, top_w = self.route(h)
        out = fused_experts(h, self.gate_up, self.down, top_ids, top_w, self.activation, use_triton,
                            self.routed_counts)  # [B, H]
        if self.shared is None:
            return out
        shared = self.shared(h, use_triton)  # [B, H]
        return out + torch.sigmoid(F.linear(h, self.shared_gate_weight)) * shared  # as Qwen2MoeSparseMoeBlock


def experts_reason(model: torch.nn.Module) -> str | None:
    """Why the model's sparse blocks are not what SparseMoE reads, or None: a router `gate` with a weight and
    an experts module of 3-D concatenated gate_up / down parameters, without biases."""
    for layer in model.model.layers:
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):
            continue  # a dense layer (mlp_only_layers, decoder_sparse_step)
        experts, gate = mlp.experts, getattr(mlp, "gate", None)
        if isinstance(experts, torch.nn.ModuleList) or getattr(getattr(experts, "gate_up_proj", None), "dim",
                                                               lambda: 0)() != 3:
            return "experts not stored as 3-D gate_up_proj / down_proj parameters (transformers < 5 layout)"
        if getattr(experts, "has_bias", False) or not getattr(experts, "is_concatenated", True):
            return "experts with biases or an interleaved gate/up layout"
        if not isinstance(getattr(gate, "weight", None), torch.Tensor) or gate.weight.dim() != 2:
            return "a router without a [num_experts, hidden] weight"
    return None


def moe_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why a Llama-layout MoE model cannot run the fused forward, or None when it can."""
    cfg = model.config.get_text_config()
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    return layout_reason(model, max_model_len) or experts_reason(model)


class MoEDecoder(LlamaDecoder):
    """The Llama layer loop with SparseMoE blocks where transformers built sparse ones. Families set how the
    router rounds (`renormalize`, `weights_fp32`) and whether a shared expert is read (`_shared`)."""
    supports_deterministic = False  # the grouped expert GEMMs' blocks depend on the batch

    weights_fp32 = False

    def _renormalize(self) -> bool:
        return bool(getattr(self.config, "norm_topk_prob", False))

    def _mlp(self, mlp: torch.nn.Module) -> GatedMLP | SparseMoE:
        if not hasattr(mlp, "experts"):
            return super()._mlp(mlp)  # a dense layer
        gate_up, down = experts_weights(mlp.experts)
        block = SparseMoE(mlp.gate.weight, gate_up, down, int(self.config.num_experts_per_tok), self._renormalize(),
                          self.weights_fp32, activation=self.activation)
        self._shared(mlp, block)
        if self.use_triton and block.router_weight.is_cuda:
            block.check_kernels(block.router_weight.dtype)
        return block

    def _shared(self, mlp: torch.nn.Module, block: SparseMoE) -> None:
        """Read the block's shared expert, if the family has one (Qwen2-MoE)."""

    def count_routes(self) -> torch.Tensor:
        """Start counting the router's choices: returns the [L, E] int64 counts (rows of dense layers stay 0),
        which every later eager step adds to; CUDA graphs count only if captured after this call. The bench's
        routed-bytes floor reads them (batchgen/bench/moe_floor.py)."""
        sparse = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
        num_experts = sparse[0].gate_up.shape[0]
        counts = torch.zeros(len(self.layers), num_experts, dtype=torch.int64, device=sparse[0].router_weight.device)
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.routed_counts = counts[i]
        return counts

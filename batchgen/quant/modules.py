"""The modules an FP8 checkpoint's projections and experts load into (quant/loader.py, quant/experts.py):
`Fp8Linear` in place of an nn.Linear, `Fp8Experts` in place of transformers 5.x's experts module, each running
the same GEMMs as the fused decoders in its own forward (transformers' modules: prefill of unfused families, the
fallback decode); and how several Fp8Linears fuse into one GEMM's weight (`fuse_fp8`).

Fusing (q/k/v, gate/up) concatenates the fp8 weights as `models/weights.fuse_linears` does bf16 ones (the modules'
weights are rebound as views into the fused tensor: no byte held twice) and the scales consistently:
per-channel scales [N_i, 1] concatenate; block scales concatenate their rows when every part but the last
starts on a block boundary (row counts multiples of group_n, as in every real checkpoint: q 4096, k/v 1024),
otherwise each part's block rows are expanded to one scale row per weight row (group_n 1, [N, ceil(K / group_k)]:
a few % more scale bytes). A per-tensor scale was already expanded to per-channel on load, so q, k and v with
different per-tensor scales fuse into one per-channel weight.
"""

from __future__ import annotations

import torch

from batchgen.kernels.fp8.gemm import fp8_linear
from batchgen.kernels.fp8.quant import FP8_DTYPE, Fp8Weight
from batchgen.kernels.moe.experts import fused_experts

__all__ = ["Fp8Experts", "Fp8Linear", "fuse_fp8", "mixed_reason"]


class Fp8Linear(torch.nn.Module):
    """An nn.Linear's replacement holding an FP8 weight and its scales; its forward (transformers' modules: prefill
    of unfused families, the fallback decode) runs the same GEMM as the fused decoders."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_n: int, group_k: int | None,
                 act_quant: bool, scale_ub: float | None = None, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_n = group_n  # rows per weight-scale block (1: per row, also per channel)
        self.group_k = group_k  # columns per weight-scale block and activation group; None: per-channel scales
        self.act_quant = act_quant  # the checkpoint quantises activations (dynamically); False: weight-only
        self.scale_ub = scale_ub  # fbgemm's activation_scale_ub: cap on an activation row's absolute max
        scale_shape = (out_features, 1) if group_k is None else \
            (-(-out_features // group_n), -(-in_features // group_k))
        # [N, K] fp8
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                         requires_grad=False)
        # [N, 1] or [ceil(N / group_n), ceil(K / group_k)] fp32
        self.weight_scale = torch.nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device=device),
                                               requires_grad=False)
        # [N] in the model's dtype, or None
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                       requires_grad=False) if bias else None

    def as_weight(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.weight_scale, self.group_n, self.group_k, self.act_quant, self.scale_ub)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.group_n, self.group_k, self.bias, self.act_quant,
                          self.scale_ub)

    def extra_repr(self) -> str:
        scales = "per channel" if self.group_k is None else f"blocks {self.group_n}x{self.group_k}"
        return f"in={self.in_features}, out={self.out_features}, fp8 {scales}, act_quant={self.act_quant}"


class Fp8Experts(torch.nn.Module):
    """A mixture-of-experts layer's experts kept in FP8, in place of transformers 5.x's experts module (same
    layout: gate_up [E, 2 I, H], the gate rows then the up rows; down [E, H, I]) with block scales [E, 2 I / group_n,
    H / group_k] and [E, H / group_n, I / group_k] (group_n must divide I: the gate and up blocks stay apart).
    quant/experts.py fills it from the checkpoint's per-expert tensors; the fused MoE decoders read `weights()`;
    its forward (transformers' sparse block: prefill of unfused paths, the fallback decode) runs the same
    kernels/moe.fused_experts."""

    # the layout flags models/moe.py reads from transformers' experts modules
    is_transposed = False
    is_concatenated = True
    has_bias = False

    def __init__(self, num_experts: int, hidden: int, inter: int, group_n: int, group_k: int, act_quant: bool,
                 scale_ub: float | None, activation: str, device: torch.device | str) -> None:
        super().__init__()
        if inter % group_n:
            raise ValueError(f"expert intermediate size {inter} is not a multiple of the scale blocks' {group_n} rows")
        self.group_n, self.group_k, self.act_quant, self.scale_ub = group_n, group_k, act_quant, scale_ub
        self.activation = activation
        self.intermediate_dim = inter

        def param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.gate_up_proj = param(num_experts, 2 * inter, hidden, dtype=FP8_DTYPE)  # [E, 2 I, H] fp8
        self.gate_up_proj_scale = param(num_experts, 2 * inter // group_n, -(-hidden // group_k), dtype=torch.float32)
        self.down_proj = param(num_experts, hidden, inter, dtype=FP8_DTYPE)  # [E, H, I] fp8
        self.down_proj_scale = param(num_experts, -(-hidden // group_n), -(-inter // group_k), dtype=torch.float32)

    def weights(self) -> tuple[Fp8Weight, Fp8Weight]:
        """(gate_up, down) as kernels/moe/experts.py takes FP8 experts."""
        return tuple(Fp8Weight(w, s, self.group_n, self.group_k, self.act_quant, self.scale_ub)
                     for w, s in ((self.gate_up_proj, self.gate_up_proj_scale), (self.down_proj, self.down_proj_scale)))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return fused_experts(hidden_states, *self.weights(), top_k_index, top_k_weights, self.activation,
                             use_triton=hidden_states.is_cuda)

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return f"experts={e}, hidden={h}, inter={two_i // 2}, fp8 blocks {self.group_n}x{self.group_k}"


def mixed_reason(groups: list[list[torch.nn.Module]]) -> str | None:
    """Why projections fused into one GEMM cannot be (FP8 and plain mixed, or different FP8 schemes), or None."""
    for modules in groups:
        kinds = {(m.group_n, m.group_k, m.act_quant, m.scale_ub) if isinstance(m, Fp8Linear) else None for m in modules}
        if len(kinds) > 1:
            return "projections fused into one GEMM are not all FP8 with one scheme (" + \
                ", ".join(type(m).__name__ for m in modules) + ")"
    return None


def fuse_fp8(linears: list[Fp8Linear], fused_weight: torch.Tensor) -> Fp8Weight:
    """The Fp8Weight of `linears` stacked by output rows, over `fused_weight` [sum N_i, K] (their fp8 weights,
    already concatenated by weights.fuse_linears). The scales are a new small tensor (see the module docstring)."""
    first = linears[0]
    if mixed_reason([linears]) is not None:
        raise ValueError(mixed_reason([linears]))
    scales = [lin.weight_scale for lin in linears]
    group_n = first.group_n
    if first.group_k is not None and any(lin.out_features % group_n for lin in linears[:-1]):
        # a part starting inside a block: one scale row per weight row
        scales = [s.repeat_interleave(group_n, 0)[:lin.out_features] for s, lin in zip(scales, linears)]
        group_n = 1
    return Fp8Weight(fused_weight, torch.cat(scales).contiguous(), group_n, first.group_k, first.act_quant,
                     first.scale_ub)

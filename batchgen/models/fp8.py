"""FP8 linear weights: `Fp8Linear`, the module an FP8 checkpoint's projections load into (runner/fp8_loader.py),
`Fp8Weight`, what the fused decoders hold for such a projection (one or several fused), and `linear`, the one
call the fused blocks make for every projection, bf16 or FP8.

Fusing (q/k/v, gate/up) concatenates the fp8 weights as `weights.fuse_linears` does bf16 ones (the modules'
weights are rebound as views into the fused tensor: no byte held twice) and the scales consistently:
per-channel scales [N_i, 1] concatenate; block scales concatenate their rows when every part but the last
starts on a block boundary (row counts multiples of group_n, as in every real checkpoint: q 4096, k/v 1024),
otherwise each part's block rows are expanded to one scale row per weight row (group_n 1, [N, ceil(K / group_k)]:
a few % more scale bytes). A per-tensor scale was already expanded to per-channel on load, so q, k and v with
different per-tensor scales fuse into one per-channel weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.kernels.fp8_gemm import fp8_linear
from batchgen.kernels.fp8_quant import FP8_DTYPE

__all__ = ["Fp8Linear", "Fp8Weight", "linear", "linear_weight", "fuse_fp8", "mixed_reason"]


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
        return linear(x, self.as_weight(), self.bias)

    def extra_repr(self) -> str:
        scales = "per channel" if self.group_k is None else f"blocks {self.group_n}x{self.group_k}"
        return f"in={self.in_features}, out={self.out_features}, fp8 {scales}, act_quant={self.act_quant}"


@dataclass(frozen=True)
class Fp8Weight:
    """One (possibly fused) FP8 projection as the fused decoders hold it. Invariant: scale's shape follows
    (group_n, group_k) and weight's as Fp8Linear's does."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N, 1] fp32 (group_k None) or [ceil(N / group_n), ceil(K / group_k)] fp32
    group_n: int
    group_k: int | None
    act_quant: bool
    scale_ub: float | None = None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None,
           fp8_path: str = "auto") -> torch.Tensor:
    """x [..., K] @ weight^T + bias: F.linear for a plain weight, the FP8 GEMM (kernels/fp8_gemm.py) for an
    Fp8Weight, by `fp8_path` (engine.fp8_gemm). Every projection of the fused blocks goes through here."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight.weight, weight.scale, weight.group_n, weight.group_k, bias, weight.act_quant,
                          weight.scale_ub, path=fp8_path)
    return F.linear(x, weight, bias)


def linear_weight(module: torch.nn.Module) -> torch.Tensor | Fp8Weight:
    """What `linear` takes for this projection module: its weight, or its Fp8Weight."""
    return module.as_weight() if isinstance(module, Fp8Linear) else module.weight


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

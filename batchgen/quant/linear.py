"""The one linear-layer interface of the models, whatever a checkpoint's format: what a fused layer holds for a
projection (`linear_weight`, `experts_weights`, `fused_weight`), the GEMM it runs on it (`make_linear`, `linear`),
and how a projection's tensors follow its weight when a tensor-parallel rank keeps a slice of it
(`row_tensors`, `column_tensors`, `experts_scale_tensors`, `sync_sizes`). The models name the types below and
never a format's own (FP8: quant/modules.py, kernels/fp8/); a new format is a case here and in those modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from batchgen.kernels.fp8.blockwise import blockwise_scaled_mm_supported, refuse_unavailable
from batchgen.kernels.fp8.gemm import fp8_linear
from batchgen.kernels.fp8.quant import ActQuant, Fp8Weight, QuantizedActs
from batchgen.kernels.fp8.splitk_common import SplitKPartials
from batchgen.kernels.invariant.linear import InvariantLinear
from batchgen.quant.modules import Fp8Experts, Fp8Linear, fuse_fp8, mixed_reason
from batchgen.quant.scheme import is_fp8, parse

__all__ = ["InputQuant", "Linear", "LinearInput", "LinearOutput", "LinearWeight", "column_tensors",
           "experts_scale_tensors", "experts_weights", "fused_weight", "linear", "linear_weight", "make_linear",
           "mixed_reason", "probe_gemms", "row_tensors", "sync_sizes"]

LinearWeight = torch.Tensor | Fp8Weight  # one projection's weight [N, K] (or several fused; experts: [E, N, K])
LinearInput = torch.Tensor | QuantizedActs  # a GEMM's input [M, K], maybe quantised already by the kernel writing it
LinearOutput = torch.Tensor | SplitKPartials  # a GEMM's output [M, N], maybe a split-K GEMM's partials, unsummed
InputQuant = ActQuant  # how a GEMM wants its input quantised by the kernel that writes it (quant/fusion.py)
# the decoder's GEMM, with F.linear's signature: `linear` (F.linear, or a quantised weight's GEMM, which also takes
# quantised inputs), or engine.deterministic's batch-invariant InvariantLinear (plain weights only)
Linear = Callable[[LinearInput, LinearWeight, torch.Tensor | None], LinearOutput]


def linear(x: LinearInput, weight: LinearWeight, bias: torch.Tensor | None = None, fp8_path: str = "auto",
           unreduced: bool = False) -> LinearOutput:
    """x [..., K] @ weight^T + bias: F.linear for a plain weight, the FP8 GEMM (kernels/fp8/gemm.py) for an FP8
    one, by `fp8_path` (engine.fp8_gemm). Every projection of the fused blocks goes through here. A quantised
    weight's GEMM also takes x already quantised and, `unreduced`, may return split-K partials (quant/fusion.py)."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight.weight, weight.scale, weight.group_n, weight.group_k, bias, weight.act_quant,
                          weight.scale_ub, path=fp8_path, unreduced=unreduced)
    return F.linear(x, weight, bias)


def make_linear(fp8_gemm: str = "auto", deterministic: bool = False) -> Linear:
    """A decoder's GEMM: batch-invariant (engine.deterministic; its InvariantLinear is the decoder's own, holding
    each weight's self-checked choice of kernel), else `linear` with engine.fp8_gemm's path."""
    if deterministic:
        return InvariantLinear()
    return linear if fp8_gemm == "auto" else functools.partial(linear, fp8_path=fp8_gemm)


def probe_gemms(config, device: torch.device, fp8_gemm: str, fused: bool) -> None:
    """The quantised GEMMs' one device probe (a sync), to run before any CUDA-graph capture: fp8_gemm.gemm_path
    reads it. A forced engine.fp8_gemm path the device lacks raises, where that path applies (`fused`: a fused
    decoder, not compiled; block scales with quantised activations). Nothing for plain checkpoints or off CUDA."""
    if not is_fp8(config) or device.type != "cuda":
        return
    device_index = device.index if device.index is not None else torch.cuda.current_device()
    blockwise_scaled_mm_supported(device_index)
    scheme = parse(config)
    if fused and scheme.group_k is not None and scheme.act_quant:
        refuse_unavailable(fp8_gemm, device_index)


def linear_weight(module: torch.nn.Module) -> LinearWeight:
    """What `linear` takes for this projection module: its weight, or its quantised weight."""
    return module.as_weight() if isinstance(module, Fp8Linear) else module.weight


def experts_weights(experts: torch.nn.Module) -> tuple[LinearWeight, LinearWeight]:
    """(gate_up [E, 2 I, H], down [E, H, I]) of a transformers 5.x experts module: its own parameters, or
    transposed views of them where the module stores them transposed; a quantised checkpoint's experts: their
    quantised weights."""
    if isinstance(experts, Fp8Experts):
        return experts.weights()
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if getattr(experts, "is_transposed", False):  # [E, H, 2 I] and [E, I, H]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, down


def fused_weight(linears: list[torch.nn.Module], fused: torch.Tensor) -> LinearWeight:
    """The weight of `linears` stacked by output rows, over `fused` [sum N_i, K] (their weights, concatenated by
    models/weights.fuse_linears): `fused` itself, or for quantised projections (all or none of them) a quantised
    weight over it with their scales joined (quant/modules.py fuse_fp8)."""
    return fuse_fp8(linears, fused) if isinstance(linears[0], Fp8Linear) else fused


# ---- tensor-parallel slices ---------------------------------------------------------------------------------------


def row_tensors(module: torch.nn.Module) -> tuple[tuple[str, int], ...]:
    """(name, weight rows one row of it covers) of the tensors that follow a projection's output rows: weight and
    bias, and a quantised weight's scales (per channel one a row, block scales one per group_n rows). A tensor
    the module lacks (a norm's bias) is None on it."""
    if isinstance(module, Fp8Linear):
        return ("weight", 1), ("bias", 1), ("weight_scale", 1 if module.group_k is None else module.group_n)
    return ("weight", 1), ("bias", 1)


def column_tensors(module: torch.nn.Module) -> tuple[tuple[str, int], ...]:
    """(name, weight columns one column of it covers) of the tensors that follow a projection's input columns:
    the weight, and a quantised weight's block scales (per-channel scales stay whole)."""
    if isinstance(module, Fp8Linear) and module.group_k is not None:
        return ("weight", 1), ("weight_scale", module.group_k)
    return (("weight", 1),)


def experts_scale_tensors(experts: torch.nn.Module) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """(gate_up's, down's) scale tensors of quantised experts as (name, axis, weight rows or columns one element
    along it covers): their blocks follow the weights' intermediate dimension; ([], []) for plain experts."""
    if not isinstance(experts, Fp8Experts):
        return [], []
    return [("gate_up_proj_scale", 1, experts.group_n)], [("down_proj_scale", 2, experts.group_k)]


def sync_sizes(module: torch.nn.Module) -> None:
    """A quantised projection's recorded sizes (in_features, out_features) set to its weight's after slicing."""
    if isinstance(module, Fp8Linear):
        module.out_features, module.in_features = module.weight.shape

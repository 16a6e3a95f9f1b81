"""Where a fused decoder's own kernels take over launches of its FP8 GEMMs (at 32 decode rows an H200
spent ~0.44 ms a step on 224 quantiser and split-K reduction launches of a few microseconds each):

  - inputs: the kernel that writes a projection's input (the RMSNorm before q/k/v and gate/up, the gated
    activation before down) quantises it itself where the projection's GEMM would quantise it per token and group
    (kernels/fp8_gemm.input_quant: block-scaled weights on the split-K, Triton and cuBLASLt block-wise paths), and
    hands the GEMM QuantizedActs: one quantize_groups launch less per such projection;
  - outputs: a split-K GEMM whose output only a residual add + RMSNorm reads (o and down) hands that kernel its
    fp32 partials unsummed (kernels/splitk_common.SplitKPartials): one reduction launch less per such GEMM;
  - attention: the QKV GEMM's partials go unsummed to the decode attention kernel (it sums them as it loads q, k
    and v), and that kernel quantises its output for the o GEMM (kernels/attention/paged_decode.py, where each head is
    whole quantisation groups): a reduction and a quantiser launch less a layer at decode steps.

All give the unfused kernels' bits: the same arithmetic on the same rounded values (kernels/norm/rmsnorm.py,
kernels/norm/gated_act.py, kernels/attention/paged_decode.py). Each decision is made per weight and per step's rows, as fp8_linear makes its path's: on
the host from shapes alone (no sync; a CUDA graph captured for a batch size keeps it). Not asked for: without
Triton (the torch references), in engine.deterministic (InvariantLinear: plain weights), and, for the outputs,
on tensor-parallel shards (their o and down outputs are all-reduced first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kernels.fp8 import gemm as fp8_gemm
from batchgen.kernels.fp8.quant import Fp8Weight, QuantizedActs, quantize_groups
from batchgen.kernels.fp8.splitk_common import SplitKPartials
from batchgen.quant.linear import InputQuant, Linear, LinearInput, LinearOutput, LinearWeight, linear


@dataclass(frozen=True)
class HandOffs:
    """A fused decoder's hand-offs between its quantised GEMMs and the kernels around them (see the module
    docstring). Invariant: fp8_path is the decoder's own GEMM's (so each decision is the path that GEMM then
    takes)."""

    fp8_path: str = "auto"  # engine.fp8_gemm
    partials: bool = True  # split-K outputs handed to the next add + norm unsummed (False: tensor-parallel shards)

    def input_quant(self, weight: LinearWeight, like: torch.Tensor) -> InputQuant | None:
        """How the GEMM of `weight` quantises an input with like's rows, dtype and device, where the kernel
        writing that input is to do it (fp8_gemm.input_quant); None: the input as a tensor (plain weights too)."""
        if not isinstance(weight, Fp8Weight):
            return None
        return fp8_gemm.input_quant(weight, like.shape[0], like.dtype, like.device, self.fp8_path)

    def linear_to_attention(self, x: LinearInput, weight: LinearWeight, bias: torch.Tensor | None) -> LinearOutput:
        """The decoder's QKV GEMM x [M, K] -> [M, N]: a split-K GEMM's partials left unsummed, for the decode
        attention kernel to sum as it loads them (blocks.attend_qkv reduces them for its other paths). Also on
        tensor-parallel shards: the QKV projection is column-parallel, nothing is all-reduced before it is read."""
        return linear(x, weight, bias, self.fp8_path, unreduced=True)

    def linear_to_norm(self, x: LinearInput, weight: LinearWeight, bias: torch.Tensor | None) -> LinearOutput:
        """The decoder's GEMM x [M, K] -> [M, N] for an output that only blocks.add_norm reads: a split-K GEMM's
        partials left unsummed where `partials`."""
        return linear(x, weight, bias, self.fp8_path, unreduced=self.partials)


def hand_offs(fp8_gemm: str, use_triton: bool, deterministic: bool, sharded: bool) -> HandOffs | None:
    """A decoder's hand-offs for its GEMMs of path `fp8_gemm` (engine.fp8_gemm), or None where none is asked:
    without Triton (the torch references) and in engine.deterministic (plain weights only). A tensor-parallel
    shard's o and down outputs are all-reduced before the norm reads them: no partials there."""
    if not use_triton or deterministic:
        return None
    return HandOffs(fp8_gemm, partials=not sharded)


def input_quant(fusion: HandOffs | None, weight: LinearWeight, like: torch.Tensor) -> InputQuant | None:
    """fusion.input_quant(weight, like), or None without hand-offs (fusion None): what a decoder passes the norm
    or activation kernel that writes weight's input."""
    return None if fusion is None else fusion.input_quant(weight, like)


def linear_to_norm(fusion: HandOffs | None, linear: Linear, x: LinearInput, weight: LinearWeight,
                   bias: torch.Tensor | None) -> LinearOutput:
    """fusion.linear_to_norm(x, weight, bias), or the decoder's `linear` without hand-offs (fusion None)."""
    return linear(x, weight, bias) if fusion is None else fusion.linear_to_norm(x, weight, bias)


def summed(x: LinearOutput) -> torch.Tensor:
    """A GEMM's output as a tensor: split-K partials reduced (one launch), a tensor as it is."""
    return x.reduce() if isinstance(x, SplitKPartials) else x


def quantized(y: torch.Tensor, quant: InputQuant | None) -> LinearInput:
    """y [M, K] quantised for the next GEMM as `quant` asks (one quantize_groups launch), or y itself (None)."""
    return y if quant is None else QuantizedActs(*quantize_groups(y, quant.group, quant.scale_ub), quant, y.dtype)


def is_quantized(x: LinearInput) -> bool:
    """Whether x is already quantised for the next GEMM (a kernel did it as it wrote x)."""
    return isinstance(x, QuantizedActs)

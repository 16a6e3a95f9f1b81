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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.kernels.fp8 import gemm as fp8_gemm
from batchgen.kernels.fp8.quant import ActQuant, Fp8Weight, QuantizedActs
from batchgen.kernels.fp8.splitk_common import SplitKPartials
from batchgen.quant.linear import linear as plain_or_fp8_linear


@dataclass(frozen=True)
class Fp8Fusion:
    """A fused decoder's hand-offs between its FP8 GEMMs and the kernels around them (see the module docstring).
    Invariant: fp8_path is the decoder's own GEMM's (so each decision is the path that GEMM then takes)."""

    fp8_path: str = "auto"  # engine.fp8_gemm
    partials: bool = True  # split-K outputs handed to the next add + norm unsummed (False: tensor-parallel shards)

    def input_quant(self, weight: torch.Tensor | Fp8Weight, like: torch.Tensor) -> ActQuant | None:
        """How the GEMM of `weight` quantises an input with like's rows, dtype and device, where the kernel
        writing that input is to do it (fp8_gemm.input_quant); None: the input as a tensor (plain weights too)."""
        if not isinstance(weight, Fp8Weight):
            return None
        return fp8_gemm.input_quant(weight, like.shape[0], like.dtype, like.device, self.fp8_path)

    def linear_to_attention(self, x: torch.Tensor | QuantizedActs, weight: torch.Tensor | Fp8Weight,
                            bias: torch.Tensor | None) -> torch.Tensor | SplitKPartials:
        """The decoder's QKV GEMM x [M, K] -> [M, N]: a split-K GEMM's partials left unsummed, for the decode
        attention kernel to sum as it loads them (blocks.attend_qkv reduces them for its other paths). Also on
        tensor-parallel shards: the QKV projection is column-parallel, nothing is all-reduced before it is read."""
        return plain_or_fp8_linear(x, weight, bias, self.fp8_path, unreduced=True)

    def linear_to_norm(self, x: torch.Tensor | QuantizedActs, weight: torch.Tensor | Fp8Weight,
                       bias: torch.Tensor | None) -> torch.Tensor | SplitKPartials:
        """The decoder's GEMM x [M, K] -> [M, N] for an output that only blocks.add_norm reads: a split-K GEMM's
        partials left unsummed where `partials`."""
        return plain_or_fp8_linear(x, weight, bias, self.fp8_path, unreduced=self.partials)


def input_quant(fusion: Fp8Fusion | None, weight: torch.Tensor | Fp8Weight, like: torch.Tensor) -> ActQuant | None:
    """fusion.input_quant(weight, like), or None without hand-offs (fusion None): what a decoder passes the norm
    or activation kernel that writes weight's input."""
    return None if fusion is None else fusion.input_quant(weight, like)


def linear_to_norm(fusion: Fp8Fusion | None, linear: Callable, x: torch.Tensor | QuantizedActs,
                   weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor | SplitKPartials:
    """fusion.linear_to_norm(x, weight, bias), or the decoder's `linear` without hand-offs (fusion None)."""
    return linear(x, weight, bias) if fusion is None else fusion.linear_to_norm(x, weight, bias)

"""InvariantLinear: engine.deterministic's GEMM, with F.linear's signature, one per decoder (its `linear`).

CPU: `linear_rows` (one GEMV per row, kernels/invariant/matmul.py). CUDA: per kind of weight (`gemm_key`), the
fixed-row cuBLAS GEMM (kernels/invariant/fixed_row_gemm.py) where it passed a self-check on this device, else the Triton
batch-invariant GEMM (`matmul_invariant`), slower, but invariant by construction.

The self-check (`row_dependence`), because the row independence of a vendor kernel is an assumption: for the
weight itself (its shape, dtype, alignment, bias), a row's output must be bitwise the same (a) at rows 0, 1, 17
and 255 of the 256-row call, (b) whatever the other rows hold (other random rows; the zero padding of a one-row
call), and (c) as a chunk of a longer M (rows 256..511 of a 512-row input). A weight that fails runs the Triton
GEMM, with one warning naming its shape. The choice is a function of the check's bits alone (no timing), so a run
and its resume on the same machine choose the same. It runs on the first call for a weight kind, which for every
weight of the model is the decoder's first step (`DecodeForward.check`, run by models/registry.py
build_deterministic) before any CUDA-graph capture; a first call inside a capture raises (the check syncs).

Hazard: the check proves the invariance on this GPU with this torch/cuBLAS. Two GPUs of the same kind (same
architecture and SM count) with the same software choose the same kernels, pass or fail alike, and agree bitwise;
a GPU of another kind, or another cuBLAS, may choose other kernels: other bits (as any GEMM), and the check runs
again there.
"""

from __future__ import annotations

import warnings

import torch

from batchgen.kernels.invariant.fixed_row_gemm import BLAS_LIBRARY, FIXED_ROWS, cublas_fixed_rows
from batchgen.kernels.invariant.matmul import linear_rows, matmul_invariant

FIXED = "fixed-row " + BLAS_LIBRARY  # InvariantLinear.paths' values
TRITON = "triton"
PROBE_ROWS = (0, 1, 17, 255)  # positions of the self-check's probe rows in the 256-row call
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two dividing t's address, up to 256 bytes (what cuBLASLt's heuristics are told)."""
    address = t.data_ptr()
    return min(256, address & -address) if address else 256


def gemm_key(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What, besides the fixed M, can change the kernel cuBLAS picks for a weight: its shape, row stride, dtype
    and address alignment, and the bias (another epilogue), with its alignment."""
    return (tuple(weight.shape), weight.stride(0), weight.dtype, _alignment(weight),
            None if bias is None else _alignment(bias))


def describe(weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """A weight as the warning names it: "6144x4096 bfloat16", "+ bias" if it has one."""
    n, k = weight.shape
    return f"{n}x{k} {str(weight.dtype).removeprefix('torch.')}" + (" + bias" if bias is not None else "")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal on floats calls -0.0 and 0.0 equal, and NaN unequal to itself)."""
    ints = INT_OF_SIZE[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def row_dependence(linear, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why `linear` (F.linear's signature, e.g. cublas_fixed_rows) is not row-independent for this weight, or
    None. Runs it on [256, K], [1, K] and [512, K] inputs of seeded random rows (a host sync)."""
    dev, (_, depth), rows = weight.device, weight.shape, FIXED_ROWS
    g = torch.Generator(device=dev).manual_seed(0)
    probe, other = (torch.randn(rows, depth, generator=g, device=dev).to(weight.dtype) for _ in range(2))
    ref = linear(probe, weight, bias)  # [rows, N]: row r of `probe` at position r, the others beside it
    # (a) and (b): probe rows moved to other positions (reversed order), the other rows replaced
    sources = list(reversed(PROBE_ROWS))
    moved = other.clone()
    moved[list(PROBE_ROWS)] = probe[sources]
    if not same_bits(linear(moved, weight, bias)[list(PROBE_ROWS)], ref[sources]):
        return f"a row's output changed with its position ({PROBE_ROWS}) and the other rows' contents"
    for r in PROBE_ROWS:  # (b): alone, beside the zero padding
        if not same_bits(linear(probe[r:r + 1], weight, bias), ref[r:r + 1]):
            return f"row {r} alone (M = 1, zero padding) differs from the same row in a full call"
    long = linear(torch.cat([other, probe]), weight, bias)  # (c): the probe rows as the second chunk
    if not same_bits(long[rows:], ref):
        return f"rows {rows}..{2 * rows - 1} of a {2 * rows}-row input differ from the same rows in one call"
    return None


class InvariantLinear:
    """F.linear whose rows do not depend on the batch. Owns the per-weight choice (`paths`: gemm_key -> FIXED
    or TRITON), made on a weight's first CUDA call by the self-check of `fixed_rows` (cublas_fixed_rows; tests
    pass stand-ins)."""

    def __init__(self, fixed_rows=cublas_fixed_rows) -> None:
        self.fixed_rows = fixed_rows
        self.paths: dict[tuple, str] = {}
        self._names: dict[tuple, str] = {}  # gemm_key -> describe(), for `summary`

    def summary(self) -> dict[str, str]:
        """{weight ("6144x4096 bfloat16 @256": shape, dtype, address alignment): path} of the weights checked."""
        return {f"{self._names[key]} @{key[3]}": path for key, path in self.paths.items()}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [M, K] -> [M, N], each row a function of that row of x alone."""
        if not x.is_cuda:
            return linear_rows(x, weight, bias)
        if self.path(weight, bias) == FIXED:
            return self.fixed_rows(x, weight, bias)
        return matmul_invariant(x if x.stride(1) == 1 else x.contiguous(), weight, bias)

    def path(self, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
        """FIXED or TRITON for this weight: the self-check's verdict, run on its kind's first call."""
        key = gemm_key(weight, bias)
        if key not in self.paths:
            if weight.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"engine.deterministic: the {describe(weight, bias)} GEMM's self-check did not "
                                   f"run before CUDA-graph capture (the decoder's first step runs every GEMM)")
            failure = row_dependence(self.fixed_rows, weight, bias)
            if failure is not None:
                warnings.warn(f"batchgen: engine.deterministic: the {FIXED} GEMM of the {describe(weight, bias)} "
                              f"weight is not row-independent on this device ({failure}); that weight runs the "
                              f"Triton batch-invariant GEMM (slower)", stacklevel=3)
            self.paths[key] = TRITON if failure is not None else FIXED
            self._names[key] = describe(weight, bias)
        return self.paths[key]

"""Batch-invariant GEMM (`engine.deterministic`): y = x @ w.T (+ bias), where row i of y is bitwise the same
whatever the other rows of x are and however many there are (M).

Why the default GEMMs are not: cuBLAS / cuBLASLt pick a kernel, a tile and a split-K factor per shape, so the
same row is summed in another order at M = 16 than at M = 256; on CPU, MKL runs M = 1 as a GEMV and M >= 3 as a
GEMM (measured on this project's CPU machines, torch 2.13, fp32: row 0 of an [M, 576] x [576, 1536] product
differs between M = 1 and M = 3 in 1,111 of its 1,536 values; tests/test_invariant_kernels.py keeps that check).

CUDA: a persistent Triton GEMM. One tile configuration for every M (BLOCK_K fixed, no split-K), so output
element (m, n) is always the same fp32 sequence of BLOCK_K-wide dot products over K in increasing order, then one
rounding; rows of a tile do not interact (masked rows load zeros, which add nothing to other rows). The
configuration may depend on N, K and the dtype (a layer's weight), never on M: that is the invariant.
M is not specialised by the JIT (`do_not_specialize`), so M = 1 and M = 16 run the same compiled code.

CPU: `linear_rows`, one [1, K] GEMV per row, each on a fresh (allocator-aligned) copy of the row: every row runs
the same call on the same bytes at the same alignment whatever the batch, so it is invariant by construction
(MKL's results may depend on the input's alignment, hence the copy). Hazard: a different thread count or CPU ISA
(AVX2 vs AVX-512 code paths) may round differently; a run and its resume on one kind of machine agree.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use linear_rows
    triton = None

# The one tile configuration per dtype (never per M). Not tuned on a GPU yet: bench/compare_outputs.py and
# `batchgen bench --workload job --job-set engine.deterministic=true` measure what it costs.
CONFIGS = {
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    torch.float16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2),
}
INTERPRETER_PROGRAMS = 4  # persistent programs under TRITON_INTERPRET (no device to ask)

if triton is not None:
    @triton.jit
    def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
        """Tile index -> (tile row, tile column), GROUP_M tile rows at a time (weight tiles reused from L2)."""
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m

    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS):
            pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            m_ok = rm < M
            n_ok = rn < N
            x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
            w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]: w.T's columns are w's rows
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):  # increasing K, one BLOCK_K chunk at a time: the fixed order
                k = k0 + rk
                k_ok = k < K
                a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if IEEE:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
            if HAS_BIAS:  # added in fp32 before the one rounding
                acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def _num_programs(device: torch.device) -> int:
    """One persistent program per SM (asked once per device: every GEMM of every step launches with it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS


def matmul_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] (a Linear's, rows contiguous); bias: [N] or None. Returns [M, N] in x's dtype,
    each row a function of that row of x alone. Triton (CUDA, or CPU under TRITON_INTERPRET=1)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
    num_rows, num_cols, depth = x.shape[0], weight.shape[0], x.shape[1]
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    cfg = dict(CONFIGS[x.dtype])
    tiles = triton.cdiv(num_rows, cfg["BLOCK_M"]) * triton.cdiv(num_cols, cfg["BLOCK_N"])
    if tiles == 0:
        return out
    # The grid size only spreads tiles over programs; a tile's arithmetic does not depend on who runs it.
    programs = _num_programs(x.device)
    _matmul_kernel[(min(programs, tiles),)](
        x, weight, bias if bias is not None else x, out, num_rows, num_cols, depth,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, NUM_PROGRAMS=programs, **cfg)
    return out


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: F.linear of each row alone ([1, K] each, on a fresh copy). x: [M, K] -> [M, N]."""
    if x.shape[0] == 0:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(x[i:i + 1].clone(), weight, bias) for i in range(x.shape[0])])


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose rows do not depend on the batch: Triton on CUDA, row by row on CPU. x: [M, K] -> [M, N]."""
    if x.is_cuda:
        return matmul_invariant(x if x.stride(1) == 1 else x.contiguous(), weight, bias)
    return linear_rows(x, weight, bias)

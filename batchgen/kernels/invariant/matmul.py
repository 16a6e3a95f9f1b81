"""Batch-invariant GEMM (`engine.deterministic`): y = x @ w.T (+ bias), where row i of y is bitwise the same
whatever the other rows of x are and however many there are (M). The Triton kernel here is invariant by
construction; on CUDA the decoders run cuBLAS at a fixed row count instead where its self-check passes
(kernels/invariant/linear.py InvariantLinear, kernels/invariant/fixed_row_gemm.py) and this kernel for weights where it does
not (and under TRITON_INTERPRET=1 in tests).

Why the default GEMMs are not: cuBLAS / cuBLASLt pick a kernel, a tile and a split-K factor per shape, so the
same row is summed in another order at M = 16 than at M = 256; on CPU, MKL runs M = 1 as a GEMV and M >= 3 as a
GEMM (measured on this project's CPU machines, torch 2.13, fp32: row 0 of an [M, 576] x [576, 1536] product
differs between M = 1 and M = 3 in 1,111 of its 1,536 values; tests/kernels/test_invariant_kernels.py keeps that
check).

CUDA: a persistent Triton GEMM whose tile configuration and K partition depend on the weight (N, K, dtype) alone,
never on M (`gemm_plan`): BLOCK_N 64 for N <= 8192 (else the dtype's 128), and a fixed split-K: K is cut at
multiples of BLOCK_K into `splits` ranges (a power of two, the smallest with cdiv(N, BLOCK_N) * splits >=
TARGET_PROGRAMS, at most MAX_SPLITS, each range >= MIN_SPLIT_BLOCKS BLOCK_K chunks). Output element (m, n) is then
always: per range s, a fresh fp32 sum of BLOCK_K-wide dot products over the range in increasing K (partial p_s);
then ((p_0 + p_1) + p_2) + ... in split order, + bias, one rounding. Rows of a tile do not interact (masked rows
load zeros, which add nothing to other rows). M is not specialised by the JIT (`do_not_specialize`).

Who computes the partials is a scheduling choice, free to follow M since it changes no arithmetic: while the tiles
are too few to fill the GPU (decode steps: o_proj and down_proj have 64 tiles of 64 columns) each (tile, range)
is a work item of its own, writing p_s in fp32 to a [splits, M, N] workspace, and a second kernel sums the
partials in split order (`_reduce_kernel`); with enough tiles (or once the workspace would cost more than a
quarter of the weight's bytes) one work item computes a tile's partials one after the other and sums them in
registers in the same order, with no workspace (`_use_workspace`). Both run the same `_partial` and the same fp32
additions, so a row's bits do not depend on the mode (the GPU tests compare M = 1 and 16 against 256, across the
switch, for every 8B shape).

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

# The tile configuration per dtype (BLOCK_N narrowed for N <= NARROW_N: `gemm_plan`), never per M. Not tuned on a
# GPU yet: bench/compare_outputs.py and `batchgen bench --workload job --job-set engine.deterministic=true` measure it.
CONFIGS = {
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    torch.float16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2),
}
NARROW_N = 8192  # weights with N <= this use 64-column tiles (twice the tiles: o_proj, down_proj, q/k/v at 8B)
TARGET_PROGRAMS = 264  # split-K aims at this many work items at M <= BLOCK_M (2 per SM of an H200's 132)
MAX_SPLITS = 8
MIN_SPLIT_BLOCKS = 2  # BLOCK_K chunks per K range, at least
INTERPRETER_PROGRAMS = 4  # persistent programs under TRITON_INTERPRET (no device to ask)
REDUCE_BLOCK = 1024  # elements per program of the partials' sum

if triton is not None:
    @triton.jit
    def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
        """Tile index -> (tile row, tile column), GROUP_M tile rows at a time (weight tiles reused from L2)."""
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m

    @triton.jit
    def _partial(x_rows, w_cols, m_ok, n_ok, k_lo, k_hi, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 [BLOCK_M, BLOCK_N]: sum over k in [k_lo, k_hi) (k_lo a multiple of BLOCK_K), from zero, one
        BLOCK_K chunk at a time in increasing K: the fixed order."""
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + rk
            k_ok = k < k_hi
            a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        return acc

    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, ws_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                       SPLITS: tl.constexpr, K_SPLIT: tl.constexpr, WORKSPACE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """WORKSPACE: work item = (tile, K range s), p_s stored to ws [SPLITS, M, N] (fp32). Else work item = tile,
        its partials summed in split order, + bias, rounded once into out."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        parts = SPLITS if WORKSPACE else 1
        for item in tl.range(tl.program_id(0), num_m * num_n * parts, NUM_PROGRAMS):
            pid_m, pid_n = _tile_coords(item // parts, num_m, num_n, GROUP_M)
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            m_ok = rm < M
            n_ok = rn < N
            x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
            w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]: w.T's columns are w's rows
            cell = rm.to(tl.int64)[:, None] * N + rn[None, :]  # [BLOCK_M, BLOCK_N] index into an [M, N] array
            if WORKSPACE:
                s = item % parts
                acc = _partial(x_rows, w_cols, m_ok, n_ok, s * K_SPLIT, tl.minimum(s * K_SPLIT + K_SPLIT, K),
                               IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
                tl.store(ws_ptr + (s * M).to(tl.int64) * N + cell, acc, mask=m_ok[:, None] & n_ok[None, :])
            else:
                acc = _partial(x_rows, w_cols, m_ok, n_ok, 0, tl.minimum(K_SPLIT, K), IEEE, BLOCK_M, BLOCK_N,
                               BLOCK_K)
                for s in range(1, SPLITS):  # in split order, as _reduce_kernel
                    acc = acc + _partial(x_rows, w_cols, m_ok, n_ok, s * K_SPLIT,
                                         tl.minimum(s * K_SPLIT + K_SPLIT, K), IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
                if HAS_BIAS:  # added in fp32 before the one rounding
                    acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _reduce_kernel(ws_ptr, bias_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr,
                       BLOCK: tl.constexpr):
        """out[m, n] = round(((p_0 + p_1) + p_2) + ... + bias): the partials of ws [SPLITS, M, N] in split order."""
        size = M.to(tl.int64) * N
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = e < size
        acc = tl.load(ws_ptr + e, mask=ok, other=0.0)
        for s in range(1, SPLITS):
            acc = acc + tl.load(ws_ptr + s * size + e, mask=ok, other=0.0)
        n = e % N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + (e // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _num_programs(device: torch.device) -> int:
    """One persistent program per SM (asked once per device: every GEMM of every step launches with it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS


@functools.cache
def gemm_plan(num_cols: int, depth: int, dtype: torch.dtype) -> tuple[dict, int, int]:
    """(tile configuration, splits, K_SPLIT) of an [N, K] weight: a function of (N, K, dtype) only, never of M
    (the invariant). K_SPLIT is a multiple of BLOCK_K; range s is [s * K_SPLIT, min((s + 1) * K_SPLIT, K)).
    Llama-8B bf16 (N x K): q/k/v 6144 x 4096: 96 column tiles x 4 splits; o 4096 x 4096: 64 x 8; gate/up
    28672 x 4096: 224 x 2; down 4096 x 14336: 64 x 8; LM head 128256 x 4096: 1002 x 1 (no split)."""
    cfg = dict(CONFIGS[dtype])
    if num_cols <= NARROW_N:
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 64)
    tiles_n = -(-num_cols // cfg["BLOCK_N"])
    k_blocks = -(-depth // cfg["BLOCK_K"])
    splits = 1
    while splits < MAX_SPLITS and tiles_n * splits < TARGET_PROGRAMS and k_blocks >= 2 * splits * MIN_SPLIT_BLOCKS:
        splits *= 2
    k_split = -(-k_blocks // splits) * cfg["BLOCK_K"]
    return cfg, -(-depth // k_split), k_split


def _use_workspace(num_rows: int, num_cols: int, depth: int, cfg: dict, splits: int) -> bool:
    """Parallel split-K (workspace) while the tiles alone are too few for the GPU and the partials' fp32 traffic
    (written and read: 8 * splits * M * N bytes) stays within a quarter of the weight's (2 * N * K). A scheduling
    choice: the arithmetic is the same either way."""
    tiles = -(-num_rows // cfg["BLOCK_M"]) * -(-num_cols // cfg["BLOCK_N"])
    return splits > 1 and tiles < TARGET_PROGRAMS and 16 * splits * num_rows <= depth


def matmul_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     workspace: bool | None = None) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] (a Linear's, rows contiguous); bias: [N] or None. Returns [M, N] in x's dtype,
    each row a function of that row of x alone. Triton (CUDA, or CPU under TRITON_INTERPRET=1). `workspace`
    (tests): force the split-K mode (None: `_use_workspace`); the bits are the same either way."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
    num_rows, num_cols, depth = x.shape[0], weight.shape[0], x.shape[1]
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out
    cfg, splits, k_split = gemm_plan(num_cols, depth, x.dtype)
    if workspace is None:
        workspace = _use_workspace(num_rows, num_cols, depth, cfg, splits)
    workspace = workspace and splits > 1
    ws = torch.empty(splits, num_rows, num_cols, dtype=torch.float32, device=x.device) if workspace else out
    items = triton.cdiv(num_rows, cfg["BLOCK_M"]) * triton.cdiv(num_cols, cfg["BLOCK_N"]) * (splits if workspace
                                                                                              else 1)
    # The grid size only spreads work items over programs; an item's arithmetic does not depend on who runs it.
    programs = _num_programs(x.device)
    bias_arg = bias if bias is not None else x
    _matmul_kernel[(min(programs, items),)](
        x, weight, bias_arg, out, ws, num_rows, num_cols, depth, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, NUM_PROGRAMS=programs, SPLITS=splits,
        K_SPLIT=k_split, WORKSPACE=workspace, **cfg)
    if workspace:
        _reduce_kernel[(triton.cdiv(num_rows * num_cols, REDUCE_BLOCK),)](
            ws, bias_arg, out, num_rows, num_cols, out.stride(0), HAS_BIAS=bias is not None, SPLITS=splits,
            BLOCK=REDUCE_BLOCK)
    return out


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: F.linear of each row alone ([1, K] each, on a fresh copy). x: [M, K] -> [M, N]."""
    if x.shape[0] == 0:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(x[i:i + 1].clone(), weight, bias) for i in range(x.shape[0])])

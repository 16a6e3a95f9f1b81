"""Candidate (not used by the engine): a Triton GEMM for decode's skinny shapes, y[M, N] = x[M, K] @ W[N, K]^T
with M <= 64, to measure against cuBLAS before wiring it into the fused decoder.

Why: at M = 32 cuBLAS reads the 8B model's q/k/v, o and down weights at 3.2-3.5 TB/s in a graphed step, where
the copy bandwidth is 4.28 TB/s (bench/RESULTS.md, session 2): ~0.5 ms of a 5.9 ms decode step.

Shape of the kernel: program (n-block, k-split) streams a [BLOCK_N, K / SPLIT_K] slab of W once and multiplies
it by all M rows of x (which stay in L2); with SPLIT_K > 1 the partial sums are added atomically into an fp32
buffer and cast at the end (two more small kernels). `python3 bench/profile_decode.py` sweeps the configs
against cuBLAS at the decode shapes; a config that wins everywhere is the one to wire in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_end
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
                    mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int = 64, block_k: int = 128,
                  split_k: int = 1, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x: [M, K] (M <= 64), weight: [N, K], both contiguous. Returns [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= 64 and x.is_contiguous() and weight.is_contiguous() and weight.shape[1] == k
    block_m = max(16, triton.next_power_of_2(m))
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n), split_k)](
        x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages)
    return y.to(x.dtype) if split_k > 1 else y


CONFIGS = [dict(block_n=bn, block_k=bk, split_k=sk)
           for bn in (32, 64, 128) for bk in (128, 256) for sk in (1, 2, 4)]

"""The split-K machinery of kernels/fp8/splitk.py (the FP8 W8A8 GEMM for decode-sized M: <= 32 rows by default,
more for the weight shapes fp8_gemm.SPLITK_SHAPE_ROWS lists), kept apart from its FP8 specifics.

The scheme: program (row tile, column tile, split) accumulates in fp32 over its range of K blocks; with SPLITS > 1
it writes its fp32 partial to a workspace [SPLITS, M, N] (torch.empty: no memset, no host sync, CUDA-graph
capturable) and a second small kernel sums the partials in split order 0, 1, ... in fp32, adds the bias in fp32
and rounds once to the output dtype. No atomics: deterministic, independent of program order. With SPLITS 1 the
GEMM kernel does that epilogue itself (`store_tile`, one launch).

SPLITS per (M, N, K) (`split_count`): enough for >= 2 programs per SM, dividing K's blocks evenly where that costs
at most twice as many splits (among those, the count that spreads the programs most evenly over the SMs), and
never fewer than MIN_BLOCKS_PER_SPLIT blocks a split.

The reduction may instead run inside the kernel that reads the GEMM's output next (`SplitKPartials`, summed by
`sum_splits`, the reduction kernel's own arithmetic: kernels/norm/rmsnorm.py sums them in its residual add + norm).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the references
    triton = None

MAX_BLOCK_M = 64  # row tile: M's power of two (>= 16, tl.dot's least); larger M runs several row tiles
MIN_BLOCKS_PER_SPLIT = 8  # K blocks (of 128) a split gets at least: 2x the pipeline's stages (splitk_config: 4)
REDUCE_BLOCK = 1024  # elements of [M, N] per program of the reduction kernel


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def block_m_for(m: int) -> int:
    return min(MAX_BLOCK_M, max(16, 1 << (m - 1).bit_length()))


def split_sizes(k_blocks: int, splits: int) -> tuple[int, int]:
    """(k blocks per split, splits launched) for `splits` requested over k_blocks blocks: none empty."""
    per_split = -(-k_blocks // max(1, min(splits, k_blocks)))
    return per_split, -(-k_blocks // per_split)


def split_count(m: int, n: int, k_blocks: int, block_n: int, sms: int) -> int:
    """Splits for (column tiles x row tiles x splits) >= 2 programs per SM: 1 where the tiles alone do (gate_up);
    else, of the counts dividing k_blocks evenly up to twice the least that reaches it, the one whose programs
    spread most evenly over the SMs (sm_balance; ties: the fewest), unless there is none (K's blocks
    with few small divisors: Qwen2-7B's down, 148 = 4 x 37), then that least, split unevenly (split_sizes: the
    last split shorter, none empty). At most k_blocks // MIN_BLOCKS_PER_SPLIT splits: a split of fewer blocks
    than that never fills its software pipeline (measured on an H200, 2026-12-02: Llama-8B's o projection at
    M = 32, 4 splits of 8 blocks 11.8 us against 8 splits of 4 blocks 12.8 us; 2 programs per SM asked for 8)."""
    tiles = -(-n // block_n) * -(-m // block_m_for(m))
    if tiles >= 2 * sms:
        return 1
    most = max(1, k_blocks // MIN_BLOCKS_PER_SPLIT)
    need = min(most, -(-2 * sms // tiles))
    even = [d for d in range(need, min(most, 2 * need) + 1) if k_blocks % d == 0]
    if not even:
        return split_sizes(k_blocks, need)[1]
    return max(even, key=lambda d: (sm_balance(tiles * d, sms), -d))


def sm_balance(programs: int, sms: int) -> float:
    """Average over busiest SM's share of `programs` equal programs dealt over `sms` SMs (1.0: every SM runs as
    many). A memory-bound GEMM ends with its busiest SM: Llama-8B's down at 32 rows, 64 column tiles, 448
    programs in 7 splits (0.85) against 512 in 8 (0.97) measured 26.0 vs 24.8 us on an H200 (2026-12-02)."""
    return programs / (-(-programs // sms) * sms)


@functools.lru_cache(maxsize=None)
def has_tma(device_index: int) -> bool:
    """Whether the GPU has the Tensor Memory Accelerator (Hopper, sm_90, and later)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def device_has_tma(t: torch.Tensor) -> bool:
    """has_tma of t's GPU; True off CUDA (the interpreter emulates TMA descriptors: the CPU tests cover that path)."""
    return has_tma(t.device.index if t.device.index is not None else torch.cuda.current_device()) if t.is_cuda \
        else True


def device_sms(t: torch.Tensor) -> int:
    """SMs of t's GPU (132, an H100 / H200, off CUDA: the interpreter's launches are sized as on the GPU)."""
    return num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device()) if t.is_cuda \
        else 132


@dataclass(frozen=True)
class SplitKPartials:
    """A split-K GEMM's output left unsummed for the kernel that reads it next: fp32 partials [S, M, N] (S >= 2)
    and the bias, to be summed in split order 0, 1, ... in fp32, the bias added in fp32, rounded once to `dtype`
    (`sum_splits`; `reduce` where the reader cannot sum)."""

    part: torch.Tensor  # [S, M, N] fp32, contiguous
    bias: torch.Tensor | None  # [N]
    dtype: torch.dtype  # the GEMM's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.part.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.part.device

    def reduce(self) -> torch.Tensor:
        """The GEMM's output [M, N] in `dtype` (reduce_splits: one launch)."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.part.device)
        reduce_splits(self.part, self.bias, out)
        return out


if triton is not None:
    # a partials reader's ACT_DTYPE constexpr: the dtype its sum is rounded to (SplitKPartials.dtype)
    TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def sum_splits(p_ptr, offs, mask, split_stride, bias_ptr, bias_offs, SPLITS: tl.constexpr,
                   HAS_BIAS: tl.constexpr):
        """The fp32 sum over s = 0, 1, ..., in that order, of the partials at p_ptr + s * split_stride + offs, plus
        the bias at bias_ptr + bias_offs in fp32: a split-K output before its one rounding (0 where masked)."""
        acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(p_ptr + s * split_stride + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + bias_offs, mask=mask, other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def store_tile(acc, bias_ptr, c_ptr, pid_m, pid_n, M, N, stride_cm, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Tile (pid_m, pid_n) of c [M, N] (row stride stride_cm) = acc [BLOCK_M, BLOCK_N] fp32 (+ bias in fp32),
        rounded once to c's dtype; rows / columns past the edge are not stored."""
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols % N).to(tl.float32)[None, :]
        out = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])

    @triton.jit
    def _splitk_reduce_kernel(p_ptr, bias_ptr, c_ptr, N, MN, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BLOCK: tl.constexpr):
        """c [M, N] = (sum over s = 0, 1, ... of partial [s, M, N], in that order, fp32) + bias, rounded once."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = sum_splits(p_ptr, offs, mask, MN, bias_ptr, offs % N, SPLITS, HAS_BIAS)
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def reduce_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] (contiguous) = sum of part [S, M, N] over S in split order + bias: no-op when part is out (one
    split: the GEMM kernel wrote the output and added the bias itself)."""
    if part is out:
        return
    m, n = out.shape
    _splitk_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
        part, bias if bias is not None else part, out, n, m * n, SPLITS=part.shape[0], HAS_BIAS=bias is not None,
        BLOCK=REDUCE_BLOCK, num_warps=4)

"""Greedy argmax over the vocabulary (Triton), for the graphed decode step, and its torch reference.

torch's argmax over [B, V] logits runs one thread block per row: at B = 32 and V = 128,256 that is 32 blocks reading 8
MB, ~35 µs of an H200 step where the bytes take ~3 µs (2026-11-29,
bench/results/2026-11-29-cublaslt-w1-transformers.md). Here the vocabulary is cut into chunks: program (row, chunk)
finds its chunk's maximum and first index of it, and a second kernel picks, per row, the first chunk holding the row's
maximum.

Same result as `torch.argmax` for finite logits, ties included (the lowest index of the maximum wins:
strict `>` across blocks and chunks, `tie_break_left` within a block). Rows of -inf give index 0, as
torch does. NaN logits are not ordered the way torch orders them (torch returns the NaN's index).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

BLOCK = 1024  # vocabulary entries one program reads per iteration
TARGET_PROGRAMS = 512  # ~4 per SM on an H200: every SM streams

if triton is not None:
    @triton.jit
    def _argmax_chunk_kernel(x_ptr, val_ptr, idx_ptr, vocab_size, stride_row, chunk, NUM_CHUNKS: tl.constexpr,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        start = c * chunk
        end = tl.minimum(start + chunk, vocab_size)
        best_val = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.zeros([], tl.int32)
        for off in tl.range(start, end, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_row + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
            val, idx = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            better = val > best_val  # strict: an equal maximum further right never replaces the first
            best_idx = tl.where(better, off + idx, best_idx)
            best_val = tl.where(better, val, best_val)
        tl.store(val_ptr + row * NUM_CHUNKS + c, best_val)
        tl.store(idx_ptr + row * NUM_CHUNKS + c, best_idx)

    @triton.jit
    def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, NUM_CHUNKS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, NUM_CHUNKS)
        vals = tl.load(val_ptr + row * NUM_CHUNKS + c)
        idxs = tl.load(idx_ptr + row * NUM_CHUNKS + c)
        _, first = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best = tl.sum(tl.where(c == first, idxs, 0), axis=0)  # idxs[first]
        tl.store(out_ptr + row, best.to(tl.int64))


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def num_chunks_for(num_rows: int, vocab_size: int) -> int:
    """Chunks per row (a power of two): about TARGET_PROGRAMS programs, each reading >= 4 blocks."""
    chunks = 1
    while num_rows * chunks * 2 <= TARGET_PROGRAMS and vocab_size // (chunks * 2) >= 4 * BLOCK:
        chunks *= 2
    return chunks


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype, last dim contiguous) -> [B] int64, the first index of each row's max.
    CUDA-graph capturable: the grid depends only on the shape. (Callers without Triton use `argmax_ref`.)"""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1
    num_chunks = num_chunks_for(num_rows, vocab_size)
    chunk = triton.cdiv(triton.cdiv(vocab_size, num_chunks), BLOCK) * BLOCK
    vals = torch.empty(num_rows * num_chunks, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(num_rows * num_chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    _argmax_chunk_kernel[(num_rows, num_chunks)](logits, vals, idxs, vocab_size, logits.stride(0), chunk,
                                                 NUM_CHUNKS=num_chunks, BLOCK=BLOCK, num_warps=4)
    _argmax_merge_kernel[(num_rows,)](vals, idxs, out, NUM_CHUNKS=num_chunks, num_warps=1)
    return out


def check(device: torch.device, vocab_size: int) -> str | None:
    """Run the kernel once on `device` against torch (ties included); None if it agrees, else why not.
    The graphs fall back to torch's argmax on a failure, so a kernel that does not build there costs speed only."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(4, vocab_size, generator=g).to(device=device, dtype=torch.bfloat16)
        x[0, 1] = x[0, vocab_size - 1] = x[0].max() + 1  # a tie far apart: the first index must win
        if torch.equal(greedy_argmax(x), argmax_ref(x)):
            return None
        return "the Triton argmax disagreed with torch.argmax"
    except Exception as e:  # a Triton build or launch failure on this device
        return f"the Triton argmax failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

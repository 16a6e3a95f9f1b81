"""Sort-free sampling of one token per row (Triton): temperature, top-k, top-p, min-p and Gumbel-max in one kernel.

The torch reference (`batchgen.sample.sampler.sample_ref`) sorts every row for top-k/top-p: at 256 rows of a
49k-128k vocabulary that radix sort, with the ~25 elementwise passes around it (softmax, cumsum, masks, the
noise hash over [rows, vocab] int64), costs ~2.5 ms of a ~12 ms 8B decode step. Here one program per row
reads its logits a few times from L2 and never writes a [rows, vocab] intermediate:

1. the row's max and min of x = logits / temperature;
2. top-k: the k-th largest x, found by a K-way search over the order-preserving integer keys of the floats
   (each pass counts the x at or above K pivots; ~8 passes for 32-bit keys) — exact, ties included;
3. top-p: the same search for the smallest x whose tokens at or above it hold at least top_p of the (top-k)
   probability mass — the kept set of the reference's sorted cumulative sum, up to float summation order;
4. min-p: keep exp(x - max) >= min_p (the probability ratio to the most likely token);
5. argmax over the kept tokens of x + Gumbel noise, the noise the reference hashes from (row key, vocab id).
Greedy rows (temperature 0) take the first index of the maximum logit, as torch.argmax.

Differences from the reference: the top-p boundary token can differ when its cumulative mass is within float
rounding of top_p, and the noise uses the GPU's fast log: a draw flips only at such near-ties.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

BLOCK = 1024  # vocabulary entries per iteration
PIVOTS = 16  # K of the K-way search: 4 bits of the 32-bit key per pass

if triton is not None:
    @triton.jit
    def _ordered_key(x):
        """float32 -> int64 with the same order (-inf lowest); bit-exact, so equal floats get equal keys."""
        b = x.to(tl.int32, bitcast=True)
        return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)

    @triton.jit
    def _mix32(x):
        """lowbias32 on int64 values in [0, 2^32), as sample.noise.mix32 (products wrap; low 32 bits kept)."""
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _scaled(row_ptr, cols, vocab_size, temp):
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        return tl.math.div_rn(x, temp)

    @triton.jit
    def _search(row_ptr, vocab_size, temp, x_max, k_key, target, lo, hi, BY_MASS: tl.constexpr,
                BLOCK: tl.constexpr, K: tl.constexpr):
        """The largest key t in [lo, hi] with F(t) >= target, given F(lo) >= target. F(t): how many tokens
        (BY_MASS false), or how much unnormalised probability exp(x - x_max) (BY_MASS true), lies at keys >= t
        among the tokens at keys >= k_key. F falls as t rises, so each pass keeps the interval between the
        last pivot that meets the target and the first that does not."""
        j = tl.arange(0, K).to(tl.int64)
        while lo < hi:
            step = (hi - lo + K - 1) // K
            piv = tl.minimum(lo + (j + 1) * step, hi)  # [K], ascending, the last == hi
            acc = tl.zeros([K], dtype=tl.float32)
            for off in range(0, vocab_size, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                x = _scaled(row_ptr, cols, vocab_size, temp)
                key = _ordered_key(x)
                counted = (cols < vocab_size) & (key >= k_key)
                if BY_MASS:
                    w = tl.where(counted, tl.exp(x - x_max), 0.0)
                else:
                    w = tl.where(counted, 1.0, 0.0)
                acc += tl.sum(tl.where(key[:, None] >= piv[None, :], w[:, None], 0.0), axis=0)
            num_ok = tl.sum((acc >= target).to(tl.int32), axis=0)  # the pivots meeting it form a prefix
            first = tl.sum(tl.where(j == 0, piv, 0), axis=0)
            last_ok = tl.sum(tl.where(j == num_ok - 1, piv, 0), axis=0)
            first_bad = tl.sum(tl.where(j == num_ok, piv, 0), axis=0)
            new_lo = tl.where(num_ok > 0, last_ok, lo)
            new_hi = tl.where(num_ok == 0, first - 1, tl.where(num_ok < K, first_bad - 1, hi))
            lo = new_lo
            hi = new_hi
        return lo

    @triton.jit
    def _sample_kernel(logits_ptr, stride_row, vocab_size, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, key_ptr,
                       out_ptr, BLOCK: tl.constexpr, K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        temp = tl.load(temp_ptr + row)
        greedy = temp == 0.0
        temp = tl.where(greedy, 1.0, temp)
        # pass 1: max and min of x (greedy: of the logits, with the first index of the max)
        x_max = tl.full([], float("-inf"), tl.float32)
        x_min = tl.full([], float("inf"), tl.float32)
        best = tl.zeros([], tl.int64)
        for off in range(0, vocab_size, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            x = _scaled(row_ptr, cols, vocab_size, temp)
            val, idx = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            best = tl.where(val > x_max, off + idx, best)  # strict: the first maximum wins across blocks
            x_max = tl.maximum(x_max, val)
            x_min = tl.minimum(x_min, tl.min(tl.where(cols < vocab_size, x, float("inf")), axis=0))
        if greedy:
            tl.store(out_ptr + row, best)
        else:
            top_k = tl.load(top_k_ptr + row)
            top_p = tl.load(top_p_ptr + row)
            min_p = tl.load(min_p_ptr + row)
            lo = _ordered_key(x_min)
            hi = _ordered_key(x_max)
            k_key = lo
            if top_k < vocab_size:
                k_key = _search(row_ptr, vocab_size, temp, x_max, lo, top_k.to(tl.float32), lo, hi, False, BLOCK, K)
            p_key = k_key
            if top_p < 1.0:
                mass = tl.zeros([], tl.float32)
                for off in range(0, vocab_size, BLOCK):
                    cols = off + tl.arange(0, BLOCK)
                    x = _scaled(row_ptr, cols, vocab_size, temp)
                    kept = (cols < vocab_size) & (_ordered_key(x) >= k_key)
                    mass += tl.sum(tl.where(kept, tl.exp(x - x_max), 0.0), axis=0)
                p_key = _search(row_ptr, vocab_size, temp, x_max, k_key, top_p * mass, k_key, hi, True, BLOCK, K)
            # last pass: Gumbel-max over the kept tokens
            noise_key = tl.load(key_ptr + row)
            best_score = tl.full([], float("-inf"), tl.float32)
            best = tl.zeros([], tl.int64)
            for off in range(0, vocab_size, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                x = _scaled(row_ptr, cols, vocab_size, temp)
                kept = (cols < vocab_size) & (_ordered_key(x) >= p_key) & (tl.exp(x - x_max) >= min_p)
                bits = _mix32(noise_key ^ _mix32(cols.to(tl.int64) + 0x27D4EB2F))
                u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
                score = tl.where(kept, x - tl.log(-tl.log(u)), float("-inf"))
                val, idx = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
                best = tl.where(val > best_score, off + idx, best)
                best_score = tl.maximum(best_score, val)
            tl.store(out_ptr + row, best)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, noise_key: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """logits [S, V] (any float dtype, last dim contiguous; penalties and suppressions already applied);
    temperature, top_p, min_p [S] float32 (temperature 0: greedy); top_k [S] int64 (V when off); noise_key [S]
    int64 in [0, 2^32). Returns [S] int64 token ids. `block`: vocabulary entries per iteration (a power of two;
    small vocabularies in tests take a small one)."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    _sample_kernel[(num_rows,)](logits, logits.stride(0), vocab_size, temperature, top_k, top_p, min_p, noise_key,
                                out, BLOCK=block, K=PIVOTS, num_warps=8)
    return out

"""Sort-free sampling of one token per row (Triton): temperature, top-k, top-p, min-p and Gumbel-max in one kernel.

The torch reference (`batchgen.sample.sampler.sample_ref`) sorts every row for top-k/top-p: at 256 rows of a
49k-128k vocabulary that radix sort, with the ~25 elementwise passes around it (softmax, cumsum, masks, the
noise hash over [rows, vocab] int64), costs ~2.5 ms of a ~12 ms 8B decode step. Here one program per row
reads its logits two or three times from L2 in the common case and never writes a [rows, vocab] intermediate:

1. the row's max and min of x = logits / temperature, and the Gumbel-max winner over the whole row (x plus the
   noise the reference hashes from (row key, vocab id));
2. top-k (when set): the k-th largest x, found by a K-way search over the order-preserving integer keys of the
   floats (each pass counts the x at or above K pivots; ~8 passes for 32-bit keys) — exact, ties included;
   with top-k or min-p (keep exp(x - max) >= min_p) the winner is redrawn among the tokens they keep;
3. top-p by rejection: a token is in the reference's kept set (its sorted cumulative sum) iff the (top-k)
   probability mass strictly above it is below top_p of the total. One pass checks the candidate and, in the
   same pass, finds the winner strictly above it: if the candidate is dropped, so is every token at or below
   it, and that winner is the Gumbel-max over what remains. The kept set holds >= top_p of what remains, so
   each round accepts with probability >= top_p (0.9: one round in ~90 % of rows); after MAX_ROUNDS the
   exact K-way search for the top-p boundary decides. Either way the token is the Gumbel-max over the kept
   set, as the reference draws it.
Greedy rows (temperature 0) take the first index of the maximum logit, as torch.argmax.

Differences from the reference: the top-p boundary token can differ when the mass above it is within float
rounding of top_p, and the noise uses the GPU's fast log: a draw flips only at such near-ties.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

BLOCK = 2048  # vocabulary entries per iteration (16 warps: 160 µs for 256 rows of 49,152 on an H200)
PIVOTS = 16  # K of the K-way search: 4 bits of the 32-bit key per pass
MAX_ROUNDS = 8  # top-p rejection rounds before the exact search (each accepts with probability >= top_p)

if triton is not None:
    @triton.jit
    def _ordered_key(x):
        """float32 -> int64 with the same order (-inf lowest); equal floats get equal keys (-0.0 is +0.0)."""
        x = tl.where(x == 0.0, 0.0, x)
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
    def _first_argmax(lane_val, lane_idx, vocab_size):
        """The maximum over lanes and the lowest column holding it (torch.argmax's tie rule)."""
        val = tl.max(lane_val, axis=0)
        return val, tl.min(tl.where(lane_val == val, lane_idx, vocab_size), axis=0)

    @triton.jit
    def _search(row_ptr, vocab_size, temp, x_max, k_key, target, lo, hi, BY_MASS: tl.constexpr,
                BLOCK: tl.constexpr, K: tl.constexpr):
        """The largest key t in [lo, hi] with F(t) >= target, given F(lo) >= target. F(t): how many tokens
        (BY_MASS false), or how much unnormalised probability exp(x - x_max) (BY_MASS true), lies at keys >= t
        among the tokens at keys >= k_key. F falls as t rises, so each pass keeps the interval between the
        last pivot that meets the target and the first that does not. The [BLOCK, K] partial sums stay in
        registers across the row; they are reduced once per pass, not once per BLOCK."""
        j = tl.arange(0, K).to(tl.int64)
        while lo < hi:
            step = (hi - lo + K - 1) // K
            piv = tl.minimum(lo + (j + 1) * step, hi)  # [K], ascending, the last == hi
            acc = tl.zeros([BLOCK, K], dtype=tl.float32)
            for off in range(0, vocab_size, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                x = _scaled(row_ptr, cols, vocab_size, temp)
                key = _ordered_key(x)
                counted = (cols < vocab_size) & (key >= k_key)
                if BY_MASS:
                    w = tl.where(counted, tl.exp(x - x_max), 0.0)
                else:
                    w = tl.where(counted, 1.0, 0.0)
                acc += tl.where(key[:, None] >= piv[None, :], w[:, None], 0.0)
            total = tl.sum(acc, axis=0)  # [K]
            num_ok = tl.sum((total >= target).to(tl.int32), axis=0)  # the pivots meeting it form a prefix
            first = tl.sum(tl.where(j == 0, piv, 0), axis=0)
            last_ok = tl.sum(tl.where(j == num_ok - 1, piv, 0), axis=0)
            first_bad = tl.sum(tl.where(j == num_ok, piv, 0), axis=0)
            new_lo = tl.where(num_ok > 0, last_ok, lo)
            new_hi = tl.where(num_ok == 0, first - 1, tl.where(num_ok < K, first_bad - 1, hi))
            lo = new_lo
            hi = new_hi
        return lo

    @triton.jit
    def _gumbel(x, cols, noise_key):
        """x + Gumbel noise of (row key, vocab id), as sample.noise.uniform_noise hashes it."""
        bits = _mix32(noise_key ^ _mix32(cols.to(tl.int64) + 0x27D4EB2F))
        # clamped below 1.0 as uniform_noise (noise.U_MAX): the top draw rounds to 1.0, whose noise is +inf
        u = tl.minimum(((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0), 0.99999994039535522)
        return x - tl.log(-tl.log(u))

    @triton.jit
    def _check_pass(row_ptr, vocab_size, temp, x_max, k_key, min_p, noise_key, cand_key, BLOCK: tl.constexpr):
        """One pass for the candidate whose key is `cand_key`: the mass exp(x - x_max) of the top-k set and of
        its part strictly above the candidate, and the next candidate (the Gumbel winner strictly above it)."""
        lanes = tl.arange(0, BLOCK)
        lane_all = tl.zeros([BLOCK], tl.float32)
        lane_above = tl.zeros([BLOCK], tl.float32)
        lane_score = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_idx = lanes
        for off in range(0, vocab_size, BLOCK):
            cols = off + lanes
            x = _scaled(row_ptr, cols, vocab_size, temp)
            key = _ordered_key(x)
            in_top_k = (cols < vocab_size) & (key >= k_key)
            p = tl.exp(x - x_max)
            w = tl.where(in_top_k, p, 0.0)
            above = key > cand_key
            lane_all += w
            lane_above += tl.where(above, w, 0.0)
            score = tl.where(in_top_k & above & (p >= min_p), _gumbel(x, cols, noise_key), float("-inf"))
            better = score > lane_score
            lane_idx = tl.where(better, cols, lane_idx)
            lane_score = tl.maximum(lane_score, score)
        score, nxt = _first_argmax(lane_score, lane_idx, vocab_size)
        return tl.sum(lane_all, axis=0), tl.sum(lane_above, axis=0), nxt, score

    @triton.jit
    def _sample_kernel(logits_ptr, stride_row, vocab_size, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, key_ptr,
                       out_ptr, BLOCK: tl.constexpr, K: tl.constexpr, MAX_ROUNDS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        temp = tl.load(temp_ptr + row)
        greedy = temp == 0.0
        temp = tl.where(greedy, 1.0, temp)
        lanes = tl.arange(0, BLOCK)
        if greedy:  # the first index of the maximum logit, as torch.argmax
            lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
            lane_idx = lanes
            for off in range(0, vocab_size, BLOCK):
                cols = off + lanes
                x = _scaled(row_ptr, cols, vocab_size, temp)
                better = x > lane_max  # strict: a lane keeps its first maximum
                lane_idx = tl.where(better, cols, lane_idx)
                lane_max = tl.where(better, x, lane_max)
            _, best = _first_argmax(lane_max, lane_idx, vocab_size)
            tl.store(out_ptr + row, best.to(tl.int64))
        else:
            top_k = tl.load(top_k_ptr + row)
            top_p = tl.load(top_p_ptr + row)
            min_p = tl.load(min_p_ptr + row)
            noise_key = tl.load(key_ptr + row)
            # pass 1: max and min of x, and the Gumbel winner over the whole row (the candidate when no filter binds)
            lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
            lane_min = tl.full([BLOCK], float("inf"), tl.float32)
            lane_score = tl.full([BLOCK], float("-inf"), tl.float32)
            lane_idx = lanes
            for off in range(0, vocab_size, BLOCK):
                cols = off + lanes
                x = _scaled(row_ptr, cols, vocab_size, temp)
                lane_max = tl.maximum(lane_max, x)
                lane_min = tl.minimum(lane_min, tl.where(cols < vocab_size, x, float("inf")))
                score = _gumbel(x, cols, noise_key)
                better = score > lane_score
                lane_idx = tl.where(better, cols, lane_idx)
                lane_score = tl.maximum(lane_score, score)
            x_max = tl.max(lane_max, axis=0)
            x_min = tl.min(lane_min, axis=0)
            _, cand = _first_argmax(lane_score, lane_idx, vocab_size)
            lo = _ordered_key(x_min)
            hi = _ordered_key(x_max)
            k_key = lo
            if top_k < vocab_size:
                k_key = _search(row_ptr, vocab_size, temp, x_max, lo, top_k.to(tl.float32), lo, hi, False, BLOCK, K)
            if (top_k < vocab_size) | (min_p > 0.0):  # the candidate must pass the filters: redraw among them
                _, _, cand, _ = _check_pass(row_ptr, vocab_size, temp, x_max, k_key, min_p, noise_key, lo - 1,
                                            BLOCK)
            # top-p by rejection: the candidate is kept iff the top-k mass strictly above it is below top_p of
            # the top-k mass; if not, no token at or below it is kept, and the next candidate is the winner
            # strictly above it. The kept set's mass is >= top_p of what remains, so a round accepts with
            # probability >= top_p; after MAX_ROUNDS the exact search decides.
            accepted = (top_p >= 1.0).to(tl.int32)
            if MAX_ROUNDS > 0:  # (a loop that can never run does not compile on every Triton)
                rounds = tl.zeros([], tl.int32)
                while (accepted == 0) & (rounds < MAX_ROUNDS):
                    cand_key = _ordered_key(_scaled(row_ptr, cand, vocab_size, temp))
                    mass, above, nxt, nxt_score = _check_pass(row_ptr, vocab_size, temp, x_max, k_key, min_p,
                                                              noise_key, cand_key, BLOCK)
                    # nothing above it to draw (only at float rounding of the masses): keep the candidate
                    accepted = ((above < top_p * mass) | (nxt_score == float("-inf"))).to(tl.int32)
                    cand = tl.where(accepted != 0, cand, nxt)
                    rounds += 1
            if accepted == 0:  # exact search for the top-p boundary, then Gumbel-max over the kept tokens
                lane_mass = tl.zeros([BLOCK], tl.float32)
                for off in range(0, vocab_size, BLOCK):
                    cols = off + lanes
                    x = _scaled(row_ptr, cols, vocab_size, temp)
                    kept = (cols < vocab_size) & (_ordered_key(x) >= k_key)
                    lane_mass += tl.where(kept, tl.exp(x - x_max), 0.0)
                mass = tl.sum(lane_mass, axis=0)
                p_key = _search(row_ptr, vocab_size, temp, x_max, k_key, top_p * mass, k_key, hi, True, BLOCK, K)
                _, _, cand, _ = _check_pass(row_ptr, vocab_size, temp, x_max, p_key, min_p, noise_key, p_key - 1,
                                            BLOCK)
            tl.store(out_ptr + row, cand.to(tl.int64))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, noise_key: torch.Tensor, block: int = BLOCK, pivots: int = PIVOTS,
                max_rounds: int = MAX_ROUNDS, num_warps: int = 16) -> torch.Tensor:
    """logits [S, V] (any float dtype, last dim contiguous; penalties and suppressions already applied);
    temperature, top_p, min_p [S] float32 (temperature 0: greedy); top_k [S] int64 (V when off); noise_key [S]
    int64 in [0, 2^32). Returns [S] int64 token ids. `block`: vocabulary entries per iteration (a power of two;
    small vocabularies in tests take a small one); `pivots`: K of the search; `max_rounds`: top-p rejection rounds (0: the
    search alone); all three are tuning and test knobs."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    _sample_kernel[(num_rows,)](logits, logits.stride(0), vocab_size, temperature, top_k, top_p, min_p, noise_key,
                                out, BLOCK=block, K=pivots, MAX_ROUNDS=max_rounds,
                                num_warps=num_warps)
    return out

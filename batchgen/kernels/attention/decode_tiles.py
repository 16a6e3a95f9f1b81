"""The Triton pieces the paged decode kernels share: rotary loads (with or without Qwen3's / Gemma3's per-head q/k
norm, from the QKV projection or its split-K partials), the online softmax over a split's K/V tiles, and a split's
partials to and from the fp32 workspace. Used by kernels/attention/paged_decode.py (per KV head) and
kernels/invariant/attention.py (one query row at a time, whose batch invariance is exactly attend_tiles' fixed tile
order)."""

from __future__ import annotations

import triton
import triton.language as tl

from batchgen.kernels.attention.paged_prefill import full_dot, paged_kv_tile, softcapped
from batchgen.kernels.attention.rope_kv import qk_norm_rounded, rotate_rounded, row_sums
from batchgen.kernels.fp8.splitk_common import sum_splits


@triton.jit
def rotated_load(ptrs, partner_ptrs, mask, cos, sin, sign):
    """Load x and its rotate-half partner (rotate_half(x)[d] = sign[d] * x[partner[d]]) and rotate them."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    xp = tl.load(partner_ptrs, mask=mask, other=0.0)
    return rotate_rounded(x, xp, cos, sin, sign)


@triton.jit
def normed_rotated(x, xp, cos, sin, sign, w_ptr, d, partner, norm_eps, HEAD_DIM: tl.constexpr,
                   UNIT_OFFSET: tl.constexpr, LOG2_HALF_D: tl.constexpr):
    """Heads RMS-normalised, then rotated, as kernels/attention/rope_kv.py's QKNorm rounds them: rows of x ([R, D_P], one head
    a row, activation dtype; masked columns 0) and their rotate-half partners xp (x[partner[d]]), each normalised
    with the row's rstd and the norm weight (w_ptr: HEAD_DIM values) at d and at partner[d], then rotated. The
    row's fp32 sum of squares in rope_kv's fixed order (the two halves' squares added, then a pairwise tree over
    2 ** LOG2_HALF_D = D_P / 2 columns): its bits do not depend on the layout the compiler picks, which follows
    the rest of the kernel (its output's store, say); for a power-of-two head dim they are rope_kv's."""
    w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    w_partner = tl.load(w_ptr + partner, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    f = x.to(tl.float32)
    f1, f2 = tl.split(tl.permute(tl.reshape(f, [f.shape[0], 2, f.shape[1] // 2]), [0, 2, 1]))  # [R, D_P / 2]
    rstd = tl.rsqrt(row_sums(f1 * f1 + f2 * f2, LOG2_HALF_D) / HEAD_DIM + norm_eps)[:, None]
    return rotate_rounded(qk_norm_rounded(x, rstd, w, UNIT_OFFSET), qk_norm_rounded(xp, rstd, w_partner, UNIT_OFFSET),
                          cos, sin, sign)


@triton.jit
def projection_load(row_ptr, cols, mask, split_stride, bias_ptr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    DTYPE: tl.constexpr):
    """Columns `cols` of one row of a projection's output (0 where masked): the output itself at row_ptr + cols
    (SPLITS 0), or the sum of a split-K GEMM's SPLITS fp32 partials there (split_stride apart) with its bias,
    rounded once to DTYPE: the values its reduction kernel would have stored (splitk_common.sum_splits)."""
    if SPLITS > 0:
        x = sum_splits(row_ptr, cols, mask, split_stride, bias_ptr, cols, SPLITS, HAS_BIAS).to(DTYPE)
    else:
        x = tl.load(row_ptr + cols, mask=mask, other=0.0)
    return x


@triton.jit
def rope_tables(cos_ptr, sin_ptr, b, stride_cs, d, d_mask, HEAD_DIM: tl.constexpr):
    """Sequence b's rotary tables over the head dims d [D_P] -> (partner [D_P]: the rotate-half partner's index,
    sign [D_P], cos [D_P] fp32, sin [D_P] fp32), for rotated_load."""
    half = HEAD_DIM // 2
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    cos = tl.load(cos_ptr + b * stride_cs + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + b * stride_cs + d, mask=d_mask, other=0.0).to(tl.float32)
    return partner, sign, cos, sin


@triton.jit
def split_program(heads_first, seq_lens_ptr, window, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_WINDOW: tl.constexpr):
    """This decode program's (sequence b, KV head h, number of KV heads, split s, seq_len, start, end, chunk):
    the grid is (sequences, KV heads, splits), or with heads_first (a runtime flag: no recompile) (KV heads,
    sequences, splits), so the programs the GPU runs side by side read the same tokens' K/V rows for neighbouring
    heads (contiguous in the cache), not one head's slice of many sequences' rows; keys [start, end) of
    split_range."""
    first, second = tl.program_id(0), tl.program_id(1)
    b = tl.where(heads_first != 0, second, first)
    h = tl.where(heads_first != 0, first, second)
    num_kv_heads = tl.where(heads_first != 0, tl.num_programs(0), tl.num_programs(1))
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start, end, chunk = split_range(seq_len, window, s, NUM_SPLITS, BLOCK_N, HAS_WINDOW)
    return b, h, num_kv_heads, s, seq_len, start, end, chunk


@triton.jit
def split_range(seq_len, window, s, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Split s of NUM_SPLITS of the keys a decode query (position seq_len - 1) sees -> (start, end, chunk): keys
    [start, end), splits of `chunk` keys (a multiple of BLOCK_N) from the window's start (Gemma2/3 layers: keys
    after position seq_len - 1 - window) or 0."""
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + s * chunk
    return start, tl.minimum(start + chunk, seq_len), chunk


@triton.jit
def softmax_step(scores, valid, m_i, l_i, softcap, HAS_SOFTCAP: tl.constexpr):
    """One tile of the online softmax: scores [R, BLOCK_N] fp32 (soft-capped here), keys where valid [BLOCK_N]
    -> (p [R, BLOCK_N], alpha [R]: the old sums' rescale, the new max m [R], the new sum l [R])."""
    if HAS_SOFTCAP:
        scores = softcapped(scores, softcap)
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def fold_new_key(score, v_new, acc, m_i, l_i, softcap, HAS_SOFTCAP: tl.constexpr):
    """The step's own token folded in last, from registers: its key's score [R] fp32 (soft-capped here) and its
    value v_new ([R, D_P], or [1, D_P] shared by a query group), p rounded to the value's dtype as a tile's
    operand is -> (acc, m, l)."""
    if HAS_SOFTCAP:
        score = softcapped(score, softcap)
    m_new = tl.maximum(m_i, score)
    p = tl.exp(score - m_new)
    alpha = tl.exp(m_i - m_new)
    acc = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
    return acc, m_new, l_i * alpha + p


@triton.jit
def attend_tiles(q, k_cache_ptr, v_cache_ptr, table_ptr, start, end, h, scale, softcap, stride_kn, stride_kb,
                 stride_kh, d, d_mask, GROUP_P: tl.constexpr, D_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Online softmax of q [GROUP_P, D_P] over the cached keys [start, end) of KV head h, BLOCK_N keys a tile in
    increasing order (table_ptr: the sequence's block-table row) -> (acc [GROUP_P, D_P] fp32 unnormalised, running
    max m [GROUP_P], running sum l [GROUP_P]). GROUP_P >= 16: the products by full_dot (tensor cores; fp32:
    IEEE); below, broadcast products summed on CUDA cores. Shared by the decode kernel (per split) and the
    batch-invariant one (kernels/invariant/attention.py), whose invariant is exactly this fixed tile order. q as
    paged_prefill.query_operand gives it (bf16 queries over an fp8 cache: fp16)."""
    m_i = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_P], dtype=tl.float32)
    acc = tl.zeros([GROUP_P, D_P], dtype=tl.float32)
    for n0 in tl.range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k, v = paged_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, pos, valid, h, stride_kn, stride_kb, stride_kh, d,
                             d_mask, BLOCK_SIZE)  # [BLOCK_N, D_P] each
        k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache: upcast to the queries' dtype (else a no-op)
        if GROUP_P >= 16:  # full_dot (tl.dot needs >= 16 rows: a small group is padded)
            scores = full_dot(q, tl.trans(k)) * scale  # [GROUP_P, BLOCK_N] fp32
        else:  # the group's rows alone, on CUDA cores (a launch's `mma=False`: MHA models' one query a KV head)
            scores = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        p, alpha, m_new, l_i = softmax_step(scores, valid, m_i, l_i, softcap, HAS_SOFTCAP)
        if GROUP_P >= 16:
            acc = acc * alpha[:, None] + full_dot(p.to(v.dtype), v)
        else:  # p rounded to v's dtype as tl.dot's operand is
            pv = p.to(v.dtype).to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :]  # [GROUP_P, BLOCK_N, D_P]
            acc = acc * alpha[:, None] + tl.sum(pv, axis=1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def store_partials(acc, m_i, l_i, acc_ptr, m_ptr, l_ptr, rows, rows_ok, d, D_P: tl.constexpr):
    """A split's (acc [GROUP_P, D_P], m [GROUP_P], l [GROUP_P]) from attend_tiles to the fp32 workspace: query head
    g's at workspace row rows[g] (acc: D_P values a row), where rows_ok (the padding heads of the tl.dot tile are
    not stored)."""
    tl.store(m_ptr + rows, m_i, mask=rows_ok)
    tl.store(l_ptr + rows, l_i, mask=rows_ok)
    tl.store(acc_ptr + rows[:, None] * D_P + d[None, :], acc, mask=rows_ok[:, None])


@triton.jit
def merge_partials(acc_ptr, m_ptr, l_ptr, rows, rows_ok, d, D_P: tl.constexpr):
    """One query head's attention output [D_P] (fp32) from its splits' partials at workspace rows [S] (split
    order); a split where not rows_ok counts as empty. The reduction's shape is S (a constexpr): callers that need
    the same bits across launches keep S fixed."""
    m = tl.load(m_ptr + rows, mask=rows_ok, other=float("-inf"))
    l = tl.load(l_ptr + rows, mask=rows_ok, other=0.0)
    acc = tl.load(acc_ptr + rows[:, None] * D_P + d[None, :], mask=rows_ok[:, None], other=0.0)  # [S, D_P]
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
    denom = tl.sum(w * l, axis=0)
    return tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)

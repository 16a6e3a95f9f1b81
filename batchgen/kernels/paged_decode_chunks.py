"""Paged decode attention for head dims that are not a power of two (Phi-3's 96, 80, 160, ...): the head dim as two
power-of-two chunks, lo = [0, D_LO) and hi = [D_LO, D_LO + D_HI) masked to HEAD_DIM.

Triton tiles are powers of two, so kernels/paged_decode.py pads a 96-dim head to 128: a quarter of every K/V tile
load, every tl.dot and every accumulator register is padding. Measured on the H200 (session 12): Phi-3-mini's
attention (32 KV heads x 96, MHA) at 1.27x its K/V bytes against OLMo2's (32 x 128, same launch shape) 1.07x. Here
the 96 dims are 64 + 32, each chunk loaded, multiplied (QK^T as the sum of the two chunks' products) and
accumulated (P.V per chunk) at its own power-of-two width; nothing is padded but the hi chunk's tail where
HEAD_DIM - D_LO is not itself a power of two (80 = 64 + 16 is exact; 112 = 64 + 64 pads 16).

Same contract as paged_decode._decode_split_kernel (grid, launch, splits, rope fusion and the new token's cache
write, sliding window, soft-cap, the partials' workspace of D_P = next_power_of_2(HEAD_DIM) columns a row, which
_decode_merge_kernel reads), without the q/k norm (no model pairs one with such a head dim; paged_decode._launch
keeps the padded kernel there) and one KV head a program. Same rounding as the padded kernel: rotate_rounded for
the rotary, p rounded to the value dtype before P.V; only the fp32 order of the QK^T sum over the head dim
differs (two tl.dots added).
"""

from __future__ import annotations

import triton
import triton.language as tl

from batchgen.kernels.decode_tiles import rope_tables, rotated_load, softmax_step, split_program, store_partials
from batchgen.kernels.paged_prefill import paged_kv_tile, softcapped


def head_chunks(head_dim: int) -> tuple[int, int]:
    """(D_LO, D_HI): the largest power of two <= head_dim, and the power of two (>= 16, tl.dot's least) that holds
    the rest; (head_dim, 0) for a power of two (the padded kernel's case: nothing to split)."""
    lo = 1 << (head_dim.bit_length() - 1)
    if lo == head_dim:
        return head_dim, 0
    return lo, max(16, triton.next_power_of_2(head_dim - lo))


@triton.jit
def _dot_rows(q, k, GROUP_P: tl.constexpr):
    """q [GROUP_P, D] . k [BLOCK_N, D]^T -> [GROUP_P, BLOCK_N] fp32: on tensor cores where GROUP_P >= 16, else
    broadcast products summed on CUDA cores (attend_tiles' two ways)."""
    if GROUP_P >= 16:
        return tl.dot(q, tl.trans(k))
    return tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _pv(p, v, GROUP_P: tl.constexpr):
    """p [GROUP_P, BLOCK_N] fp32 rounded to v's dtype, times v [BLOCK_N, D] -> [GROUP_P, D] fp32."""
    if GROUP_P >= 16:
        return tl.dot(p.to(v.dtype), v)
    return tl.sum(p.to(v.dtype).to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


@triton.jit(do_not_specialize=["heads_first", "stride_bt"])  # as paged_decode._decode_split_kernel
def _decode_chunks_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    acc_ptr, m_ptr, l_ptr, out_ptr,
    cos_ptr, sin_ptr, slot_ptr,  # FUSE_ROPE only
    scale, softcap, window, heads_first,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_cs,
    stride_kn, stride_kb, stride_kh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
    D_LO: tl.constexpr, D_HI: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FUSE_ROPE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    b, h, num_kv_heads, s, seq_len, start, end, chunk = split_program(heads_first, seq_lens_ptr, window, NUM_SPLITS,
                                                                      BLOCK_N, HAS_WINDOW)

    g = tl.arange(0, GROUP_P)
    g_mask = g < GROUP
    d_lo = tl.arange(0, D_LO)
    d_hi = D_LO + tl.arange(0, D_HI)
    lo_mask = d_lo < HEAD_DIM  # all true: D_LO < HEAD_DIM
    hi_mask = d_hi < HEAD_DIM
    q_rows = q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh
    if FUSE_ROPE:  # q_ptr is the QKV projection [B, (H + 2 Hkv) D]; this step's K/V are not cached yet
        p_lo, sign_lo, cos_lo, sin_lo = rope_tables(cos_ptr, sin_ptr, b, stride_cs, d_lo, lo_mask, HEAD_DIM)
        p_hi, sign_hi, cos_hi, sin_hi = rope_tables(cos_ptr, sin_ptr, b, stride_cs, d_hi, hi_mask, HEAD_DIM)
        end = tl.minimum(end, seq_len - 1)
        new_pos = seq_len - 1
        has_new = (new_pos >= start) & (new_pos < start + chunk)
        k_row = q_ptr + b * stride_qb + (GROUP * num_kv_heads + h) * HEAD_DIM
        q_lo = rotated_load(q_rows + d_lo[None, :], q_rows + p_lo[None, :], g_mask[:, None] & lo_mask[None, :],
                            cos_lo[None, :], sin_lo[None, :], sign_lo[None, :])  # [GROUP_P, D_LO]
        q_hi = rotated_load(q_rows + d_hi[None, :], q_rows + p_hi[None, :], g_mask[:, None] & hi_mask[None, :],
                            cos_hi[None, :], sin_hi[None, :], sign_hi[None, :])  # [GROUP_P, D_HI]
        k_new_lo = rotated_load(k_row + d_lo, k_row + p_lo, lo_mask & has_new, cos_lo, sin_lo, sign_lo)
        k_new_hi = rotated_load(k_row + d_hi, k_row + p_hi, hi_mask & has_new, cos_hi, sin_hi, sign_hi)
        k_new_lo = k_new_lo.to(k_cache_ptr.dtype.element_ty)
        k_new_hi = k_new_hi.to(k_cache_ptr.dtype.element_ty)
        v_row = k_row + num_kv_heads * HEAD_DIM
        v_new_lo = tl.load(v_row + d_lo, mask=lo_mask & has_new, other=0.0).to(v_cache_ptr.dtype.element_ty)
        v_new_hi = tl.load(v_row + d_hi, mask=hi_mask & has_new, other=0.0).to(v_cache_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + b, mask=has_new, other=0).to(tl.int64)  # = block * BLOCK_SIZE + offset
    else:
        q_lo = tl.load(q_rows + d_lo[None, :], mask=g_mask[:, None] & lo_mask[None, :], other=0.0)
        q_hi = tl.load(q_rows + d_hi[None, :], mask=g_mask[:, None] & hi_mask[None, :], other=0.0)

    # the online softmax over the split's tiles (decode_tiles.attend_tiles, each product as two chunks)
    table_ptr = block_tables_ptr + b * stride_bt
    m_i = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_P], dtype=tl.float32)
    acc_lo = tl.zeros([GROUP_P, D_LO], dtype=tl.float32)
    acc_hi = tl.zeros([GROUP_P, D_HI], dtype=tl.float32)
    for n0 in tl.range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k_lo, v_lo = paged_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, pos, valid, h, stride_kn, stride_kb,
                                   stride_kh, d_lo, lo_mask, BLOCK_SIZE)  # [BLOCK_N, D_LO] each
        k_hi, v_hi = paged_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, pos, valid, h, stride_kn, stride_kb,
                                   stride_kh, d_hi, hi_mask, BLOCK_SIZE)  # [BLOCK_N, D_HI] each
        scores = (_dot_rows(q_lo, k_lo, GROUP_P) + _dot_rows(q_hi, k_hi, GROUP_P)) * scale  # [GROUP_P, BLOCK_N]
        p, alpha, m_i, l_i = softmax_step(scores, valid, m_i, l_i, softcap, HAS_SOFTCAP)
        acc_lo = acc_lo * alpha[:, None] + _pv(p, v_lo, GROUP_P)
        acc_hi = acc_hi * alpha[:, None] + _pv(p, v_hi, GROUP_P)

    if FUSE_ROPE:
        if has_new:  # the step's own token: written to its cache slot, then folded in last from registers
            base = slot * stride_kb + h * stride_kh
            tl.store(k_cache_ptr + base + d_lo, k_new_lo, mask=lo_mask)
            tl.store(k_cache_ptr + base + d_hi, k_new_hi, mask=hi_mask)
            tl.store(v_cache_ptr + base + d_lo, v_new_lo, mask=lo_mask)
            tl.store(v_cache_ptr + base + d_hi, v_new_hi, mask=hi_mask)
            score = (tl.sum(q_lo.to(tl.float32) * k_new_lo.to(tl.float32)[None, :], axis=1)
                     + tl.sum(q_hi.to(tl.float32) * k_new_hi.to(tl.float32)[None, :], axis=1)) * scale
            if HAS_SOFTCAP:
                score = softcapped(score, softcap)
            m_new = tl.maximum(m_i, score)
            p_new = tl.exp(score - m_new)
            alpha = tl.exp(m_i - m_new)
            p_v = p_new.to(v_new_lo.dtype).to(tl.float32)[:, None]  # rounded as a tile's p is
            acc_lo = acc_lo * alpha[:, None] + p_v * v_new_lo.to(tl.float32)[None, :]
            acc_hi = acc_hi * alpha[:, None] + p_v * v_new_hi.to(tl.float32)[None, :]
            m_i, l_i = m_new, l_i * alpha + p_new

    if NUM_SPLITS == 1:  # the whole context is here: the output itself (an empty sequence's l is 0: zeros)
        inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = out_ptr + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh
        tl.store(o_rows + d_lo[None, :], (acc_lo * inv).to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & lo_mask[None, :])
        tl.store(o_rows + d_hi[None, :], (acc_hi * inv).to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & hi_mask[None, :])
        return
    part = (b * num_kv_heads + h) * NUM_SPLITS + s  # index of this (seq, kv head, split)
    rows = part * GROUP_P + g
    store_partials(acc_lo, m_i, l_i, acc_ptr, m_ptr, l_ptr, rows, g_mask, d_lo, D_P)
    # the hi chunk's columns of the same workspace rows (m and l stored once above; columns past HEAD_DIM are
    # never read back into the output)
    tl.store(acc_ptr + rows[:, None] * D_P + d_hi[None, :], acc_hi, mask=g_mask[:, None] & hi_mask[None, :])


def launch_chunks_kernel(grid, args: tuple, head_dim: int, **meta) -> None:
    """_decode_chunks_kernel over `grid` with paged_decode._launch's arguments (no q/k norm pair) and constexprs
    (HEAD_DIM, D_P, GROUP, ...); D_LO and D_HI from head_chunks."""
    d_lo, d_hi = head_chunks(head_dim)
    assert d_hi, f"head dim {head_dim} is a power of two: the padded kernel has nothing to pad"
    _decode_chunks_kernel[grid](*args, HEAD_DIM=head_dim, D_LO=d_lo, D_HI=d_hi, **meta)

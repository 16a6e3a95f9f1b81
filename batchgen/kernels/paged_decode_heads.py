"""Paged decode attention for MHA models (one query head per KV head: Phi-3, OLMo2, Gemma-7B), several KV heads
a program: `DecodeLaunch(heads_per_program=HB)` (kernels/paged_decode.py dispatches here).

Why: the cache holds a token's K (and V) for all its KV heads side by side ([num_blocks, block_size, Hkv, D]),
so one token's row for 32 heads of 96 is 6 KB of contiguous memory. The per-head kernel reads one head's 192-byte
slice of it per program; Phi-3's decode attention ran at 1.71x its K/V bytes on the H200 that way. Here program
(sequence, head block, split) reads HB neighbouring heads' slices of each token, HB x 192 bytes contiguous, and
computes each head's online softmax on CUDA cores (an MHA head has one query row: nothing for tensor cores to
share). Whether this beats the per-head kernel is measured by bench/decode_attention_sweep.py before any default
uses it.

Same contract as paged_decode's split kernel: the rotary embedding and the new token's K/V write fused in (the
program whose split holds the new position writes it and folds it in last, from registers), splits merged by
paged_decode's merge kernel (GROUP_P 1: one workspace row per (sequence, KV head, split)).
"""

from __future__ import annotations

import triton
import triton.language as tl

from batchgen.kernels.decode_tiles import (fold_new_key, rope_tables, rotated_load, softmax_step, split_range,
                                          store_partials)
from batchgen.kernels.rope_kv import as_cached


@triton.jit(do_not_specialize=["stride_bt"])  # as paged_decode._decode_split_kernel
def decode_heads_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    acc_ptr, m_ptr, l_ptr, out_ptr,
    cos_ptr, sin_ptr, slot_ptr,  # FUSE_ROPE only
    scale, softcap, window,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_cs,
    stride_kn, stride_kb, stride_kh,
    stride_bt,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FUSE_ROPE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    h0 = tl.program_id(1) * HEADS  # this program's first KV (= query) head
    s = tl.program_id(2)
    num_kv_heads = tl.num_programs(1) * HEADS
    seq_len = tl.load(seq_lens_ptr + b)
    start, end, chunk = split_range(seq_len, window, s, NUM_SPLITS, BLOCK_N, HAS_WINDOW)

    hb = tl.arange(0, HEADS)
    d = tl.arange(0, D_P)
    d_mask = d < HEAD_DIM
    hd_mask = (hb[:, None] >= 0) & d_mask[None, :]  # [HEADS, D_P]
    q_rows = q_ptr + b * stride_qb + (h0 + hb)[:, None] * stride_qh
    if FUSE_ROPE:  # q_ptr is the QKV projection [B, (H + 2 Hkv) D]; this step's K/V are not cached yet
        partner, sign, cos, sin = rope_tables(cos_ptr, sin_ptr, b, stride_cs, d, d_mask, HEAD_DIM)
        q = rotated_load(q_rows + d[None, :], q_rows + partner[None, :], hd_mask, cos[None, :], sin[None, :],
                         sign[None, :])  # [HEADS, D_P]
        end = tl.minimum(end, seq_len - 1)
        new_pos = seq_len - 1
        has_new = (new_pos >= start) & (new_pos < start + chunk)
        k_rows = q_ptr + b * stride_qb + (num_kv_heads + h0 + hb)[:, None] * HEAD_DIM  # MHA: H == Hkv
        new_mask = hd_mask & has_new
        k_new = rotated_load(k_rows + d[None, :], k_rows + partner[None, :], new_mask, cos[None, :], sin[None, :],
                             sign[None, :])  # [HEADS, D_P]
        k_new = as_cached(k_new, k_cache_ptr)  # as stored (an fp8 cache's rounding)
        v_new = as_cached(tl.load(k_rows + num_kv_heads * HEAD_DIM + d[None, :], mask=new_mask, other=0.0),
                          v_cache_ptr)
        slot = tl.load(slot_ptr + b, mask=has_new, other=0).to(tl.int64)  # = block * BLOCK_SIZE + offset
    else:
        q = tl.load(q_rows + d[None, :], mask=hd_mask, other=0.0)
    q = q.to(tl.float32)

    m_i = tl.full([HEADS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS], dtype=tl.float32)
    acc = tl.zeros([HEADS, D_P], dtype=tl.float32)
    table = block_tables_ptr + b * stride_bt
    for n0 in tl.range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_kn + (pos % BLOCK_SIZE) * stride_kb  # [BLOCK_N]
        offs = row[None, :, None] + (h0 + hb)[:, None, None] * stride_kh + d[None, None, :]  # [HEADS, BLOCK_N, D_P]
        kv_mask = valid[None, :, None] & d_mask[None, None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k, axis=2) * scale  # [HEADS, BLOCK_N]
        p, alpha, m_new, l_i = softmax_step(scores, valid, m_i, l_i, softcap, HAS_SOFTCAP)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)  # an fp8 cache: upcast
        p = p.to(v.dtype).to(tl.float32)  # rounded to V's dtype, as the tensor-core kernel's operand is
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32), axis=1)
        m_i = m_new

    if FUSE_ROPE:
        if has_new:
            cache_offs = slot * stride_kb + (h0 + hb)[:, None] * stride_kh + d[None, :]
            tl.store(k_cache_ptr + cache_offs, k_new, mask=hd_mask)
            tl.store(v_cache_ptr + cache_offs, v_new, mask=hd_mask)
            score = tl.sum(q * k_new.to(tl.float32), axis=1) * scale  # [HEADS]
            acc, m_i, l_i = fold_new_key(score, v_new.to(q_ptr.dtype.element_ty), acc, m_i, l_i, softcap,
                                         HAS_SOFTCAP)

    if NUM_SPLITS == 1:  # the whole context is here: the output itself (an empty sequence's l is 0: zeros)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + (h0 + hb)[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hd_mask)
        return
    part = (b * num_kv_heads + h0 + hb) * NUM_SPLITS + s  # [HEADS]: one workspace row per (seq, head, split)
    store_partials(acc, m_i, l_i, acc_ptr, m_ptr, l_ptr, part, hb >= 0, d, D_P)

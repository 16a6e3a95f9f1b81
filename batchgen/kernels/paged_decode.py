"""Triton paged decode attention: one query token per sequence, K/V read from the paged cache.

Split-K over the context: program (seq, kv_head, split) streams its slice of the sequence's K/V once
for all G query heads that share that KV head (GQA), keeping an online softmax; a second kernel merges
the splits. With one split (enough sequences to fill the GPU) the split kernel normalises and writes the
output itself, and no merge kernel runs. The grid depends only on (num_seqs, num_kv_heads, NUM_SPLITS) and every piece of metadata
is read from device tensors, so a step can be captured in a CUDA graph and replayed with new contents.
A sequence with seq_len == 0 (a padding row of a graph bucket) gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    acc_ptr, m_ptr, l_ptr, out_ptr,
    scale,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kn, stride_kb, stride_kh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = s * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D_P)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [GROUP_P, D_P]

    m_i = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_P], dtype=tl.float32)
    acc = tl.zeros([GROUP_P, D_P], dtype=tl.float32)
    for n0 in tl.range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(block_tables_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_kn + (pos % BLOCK_SIZE) * stride_kb + h * stride_kh  # [BLOCK_N]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_P]
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale  # [GROUP_P, BLOCK_N] fp32
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SPLITS == 1:  # the whole context is here: the output itself (an empty sequence's l is 0: zeros)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        return
    # Only the GROUP real query rows are stored (tl.dot pads the group to >= 16 rows; storing the padding
    # would write up to 4x the partials the merge reads).
    part = (b * tl.num_programs(1) + h) * NUM_SPLITS + s  # index of this (seq, kv head, split)
    tl.store(m_ptr + part * GROUP_P + g, m_i, mask=g_mask)
    tl.store(l_ptr + part * GROUP_P + g, l_i, mask=g_mask)
    tl.store(acc_ptr + (part * GROUP_P + g)[:, None] * D_P + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_merge_kernel(
    acc_ptr, m_ptr, l_ptr, out_ptr,
    stride_ob, stride_oh,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // GROUP
    g = hq % GROUP
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_P)
    part = (b * NUM_KV_HEADS + h) * NUM_SPLITS + s  # [S]
    m = tl.load(m_ptr + part * GROUP_P + g)
    l = tl.load(l_ptr + part * GROUP_P + g)
    acc = tl.load(acc_ptr + (part * GROUP_P + g)[:, None] * D_P + d[None, :])  # [S, D_P]
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
    denom = tl.sum(w * l, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def default_num_splits(num_seqs: int, num_kv_heads: int, target_programs: int = 256) -> int:
    """Context splits per (sequence, KV head): enough programs to keep every SM streaming (~2 per SM on
    an H200's 132 SMs), no more, since each split writes partials the merge must read back (and one split
    needs no merge at all). Depends only on the batch shape, so a CUDA graph captured for a bucket keeps a
    valid grid for any context length. bench/profile_decode.py measured the launch choices below."""
    splits = 1
    while splits < 32 and num_seqs * num_kv_heads * splits < target_programs:
        splits *= 2
    return splits


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D] one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32 (0 for padding rows)
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,  # None: the launch bench/profile_decode measured best (below)
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:  # [B, H, D]
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads)
    # H200, 32 seqs x 768 context, Llama-8B heads: 1 split at block_n 128 / 4 warps, 2 splits at 64 / 2 warps
    block_n = block_n or (128 if num_splits == 1 else 64)
    num_warps = num_warps or (4 if num_splits == 1 else 2)
    group = num_heads // num_kv_heads
    group_p = max(16, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows
    d_p = max(16, triton.next_power_of_2(head_dim))
    assert k_cache.stride(3) == 1 and query.stride(2) == 1 and num_splits & (num_splits - 1) == 0
    dev = query.device
    out = torch.empty_like(query)
    if num_splits == 1:  # unused by the kernel, which writes `out` directly
        acc = m = l = out
    else:
        acc = torch.empty(num_seqs * num_kv_heads * num_splits * group_p * d_p, dtype=torch.float32, device=dev)
        m = torch.empty(num_seqs * num_kv_heads * num_splits * group_p, dtype=torch.float32, device=dev)
        l = torch.empty_like(m)
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, acc, m, l, out, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, D_P=d_p, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, **launch,
    )
    if num_splits == 1:
        return out
    _decode_merge_kernel[(num_seqs, num_heads)](
        acc, m, l, out, out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, D_P=d_p, NUM_SPLITS=num_splits,
    )
    return out

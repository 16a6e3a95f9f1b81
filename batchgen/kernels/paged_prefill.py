"""Triton paged prefill attention: ragged query chunks over each sequence's cached context (chunked prefill).

The step's K/V are already in the cache. Work is split into items of up to BLOCK_M query tokens of one
sequence (a host-built list, `prefill_work`); program (item, kv head, head chunk) holds BLOCK_M tokens x
HEADS query heads that share one KV head as the rows of one tile, and streams that sequence's K/V blocks
once for all of them with an online softmax (flash-attention style), causal by absolute position, with
optional sliding window and logit softcap. No padding to the longest sequence, no mask tensor.

The torch reference is `paged_attention_ref` (same arguments less the work list).
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

BLOCK_M = 16  # query tokens per work item


def prefill_work(q_lens: np.ndarray, query_start_loc: np.ndarray) -> np.ndarray:
    """[P, 2] int32 work items (sequence index, packed index of the item's first token), in sequence order:
    ceil(q_len / BLOCK_M) items per sequence."""
    counts = (q_lens + BLOCK_M - 1) // BLOCK_M
    seq = np.repeat(np.arange(len(q_lens)), counts)
    first_item = np.cumsum(counts) - counts
    offset = np.arange(len(seq)) - np.repeat(first_item, counts)
    return np.stack([seq, query_start_loc[:-1][seq] + BLOCK_M * offset], axis=1).astype(np.int32)


if triton is not None:
    @triton.jit
    def softcapped(s, softcap):
        """softcap * tanh(s / softcap), with tanh from one exp of a non-positive argument (no overflow)."""
        x = s / softcap
        e = tl.exp(-2.0 * tl.abs(x))
        return softcap * tl.where(x >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e)

    @triton.jit
    def paged_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, pos, pos_ok, h, stride_kn, stride_kb, stride_kh, d, d_ok,
                      BLOCK_SIZE: tl.constexpr):
        """K and V [BLOCK_N, D_P] of KV head h at token positions pos [BLOCK_N] of one sequence (table_ptr: its
        block-table row), zeros where not pos_ok or past the head dim. Shared with the decode kernels
        (kernels/decode_tiles.py)."""
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        row = block * stride_kn + (pos % BLOCK_SIZE) * stride_kb + h * stride_kh  # [BLOCK_N]
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        return k, v

    @triton.jit(do_not_specialize=["stride_bt"])  # the step's block-table width varies (paged_decode.py)
    def _prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, work_ptr, qsl_ptr, seq_lens_ptr, block_tables_ptr,
        scale, softcap, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kn, stride_kb, stride_kh, stride_bt,
        GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    ):
        item = tl.program_id(0)
        h = tl.program_id(1)  # KV head
        chunk = tl.program_id(2)  # which HEADS of the GROUP query heads of this KV head
        seq = tl.load(work_ptr + item * 2)
        tok0 = tl.load(work_ptr + item * 2 + 1)
        q_start = tl.load(qsl_ptr + seq)
        q_end = tl.load(qsl_ptr + seq + 1)
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - (q_end - q_start)  # cached tokens before this step's chunk

        ROWS: tl.constexpr = BLOCK_M * HEADS
        r = tl.arange(0, ROWS)
        tok = tok0 + r // HEADS
        g = chunk * HEADS + r % HEADS
        row_ok = (tok < q_end) & (g < GROUP)
        head = h * GROUP + g
        q_pos = ctx + tok - q_start  # absolute position of each row's token
        d = tl.arange(0, D_P)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [ROWS, D_P]

        last_pos = tl.minimum(ctx + tok0 - q_start + BLOCK_M - 1, seq_len - 1)
        kv_end = last_pos + 1
        kv_start = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(ctx + tok0 - q_start - window + 1, 0) // BLOCK_N * BLOCK_N

        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, D_P], dtype=tl.float32)
        for n0 in tl.range(kv_start, kv_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pos_ok = pos < kv_end
            k, v = paged_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, pos,
                                 pos_ok, h, stride_kn, stride_kb, stride_kh, d, d_ok, BLOCK_SIZE)
            k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache: upcast to the queries' dtype (else a no-op)
            s = tl.dot(q, tl.trans(k)) * scale  # [ROWS, BLOCK_N] fp32
            if HAS_SOFTCAP:
                s = softcapped(s, softcap)
            visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (q_pos[:, None] - pos[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_prefill_attention(
    query: torch.Tensor,  # [T, H, D] packed queries of all sequences
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], holding this step's keys already
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_tables: torch.Tensor,  # [S, W] int32
    work: torch.Tensor,  # [P, 2] int32 from `prefill_work` (any subset of it: only those tokens are written)
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,  # [T, H, D]; rows outside `work` are left as they are
    block_n: int = 64,
) -> torch.Tensor:
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    heads = min(triton.next_power_of_2(group), 4)
    assert k_cache.stride(3) == 1 and query.stride(2) == 1 and BLOCK_M * heads >= 16
    out = torch.empty_like(query) if out is None else out
    if work.shape[0] == 0:
        return out
    grid = (work.shape[0], num_kv_heads, triton.cdiv(group, heads))
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, work, query_start_loc, seq_lens, block_tables,
        scale, softcap or 1.0, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEADS=heads, HEAD_DIM=head_dim, D_P=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        HAS_SOFTCAP=softcap is not None, HAS_WINDOW=sliding_window is not None,
        num_warps=4, num_stages=2,
    )
    return out

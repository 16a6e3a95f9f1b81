"""Batch-invariant paged attention (`engine.deterministic`): one query token per row, whether the token comes in a
decode step, a whole prefill or a chunk of one, so a token's attention output is bitwise the same in all three.

Why the default kernels are not: the decode kernel splits the context into a number of parts chosen from the
batch size (`paged_decode.default_num_splits`) and its tile width from the batch too; the prefill kernel holds
16 tokens per tile and its online softmax runs over other tile boundaries; the fused rotary decode kernel folds
the new token in last, from registers. Each is a different summation order for the same token.

Here program (row, KV head) streams the row's sequence from its first visible key to its own position in tiles
of BLOCK_N keys that start at a position fixed by the token alone (0, or the window's start), with one online
softmax (fp32) in increasing key order and no splits; the G query heads of the KV head are the rows of one tl.dot
tile (rows do not interact). Nothing in a row's arithmetic depends on the other rows, the step's shape, or
whether its own key was written in this step (every key is read back from the cache: rope_kv writes them first).
Cost: no split over the context (a long context at a small batch is one program per (row, KV head)), and a
prefill chunk's tokens each read their own context (no reuse across the 16 tokens of a prefill tile).

CPU: `query_attention_rows`, the torch reference (`paged_attention_ref`) called once per row with that row's own
length, so each row's shapes, and hence its arithmetic, are a function of its position alone.
"""

from __future__ import annotations

import torch

from batchgen.kernels.paged_attention_ref import paged_attention_ref

try:
    import triton
    import triton.language as tl

    from batchgen.kernels.paged_decode import attend_tiles
except ImportError:  # installs without Triton (CPU) use query_attention_rows
    triton = None

BLOCK_N = 32  # keys per tile: fixed for every row, step and batch (the invariant); not tuned on a GPU yet
NUM_WARPS = 2

if triton is not None:
    @triton.jit
    def _query_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, row_seq_ptr, kv_lens_ptr, block_tables_ptr,
        scale, softcap, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kn, stride_kb, stride_kh, stride_bt,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ROW_SEQ: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        kv_len = tl.load(kv_lens_ptr + t)  # keys the row sees: its position + 1; 0 (a graph's padding row): zeros
        seq = t
        if HAS_ROW_SEQ:
            seq = tl.load(row_seq_ptr + t).to(tl.int64)
        lo = 0
        if HAS_WINDOW:  # the query (position kv_len - 1) sees positions > kv_len - 1 - window
            lo = tl.maximum(kv_len - window, 0)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, D_P)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + t * stride_qt + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [GROUP_P, D_P]
        acc, m_i, l_i = attend_tiles(q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, lo, kv_len, h,
                                     scale, softcap, stride_kn, stride_kb, stride_kh, d, d_ok, GROUP_P, D_P,
                                     BLOCK_SIZE, BLOCK_N, HAS_SOFTCAP)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + t * stride_ot + (h * GROUP + g)[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def query_attention(
    query: torch.Tensor,  # [R, H, D] one query token per row
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], holding every key a row sees (its own included)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, W] int32
    kv_lens: torch.Tensor,  # [R] int32: the row's position + 1 (0: a padding row, output zeros)
    row_seq: torch.Tensor | None,  # [R] int32: the row's sequence (its block table row); None: row r is sequence r
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [R, H, D]
    """Triton (CUDA, or CPU under TRITON_INTERPRET=1); graph-capturable: every input is read on the device."""
    num_rows, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert query.stride(2) == 1 and k_cache.stride(3) == 1 and kv_lens.dtype == torch.int32
    out = torch.empty(num_rows, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_rows == 0:
        return out
    _query_attention_kernel[(num_rows, num_kv_heads)](
        query, k_cache, v_cache, out, row_seq if row_seq is not None else kv_lens, kv_lens, block_tables,
        scale, softcap or 1.0, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        D_P=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        HAS_ROW_SEQ=row_seq is not None, HAS_SOFTCAP=softcap is not None, HAS_WINDOW=sliding_window is not None,
        num_warps=NUM_WARPS,
    )
    return out


def query_attention_rows(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, kv_lens: torch.Tensor, row_seq: torch.Tensor | None,
                         scale: float, sliding_window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """The CPU path (same arguments as `query_attention`): the reference once per row, over exactly the row's
    kv_len keys, on a fresh copy of its query (fresh buffers: the same alignment whatever the batch)."""
    out = torch.zeros_like(query)  # [R, H, D]
    lens = kv_lens.tolist()
    seqs = row_seq.tolist() if row_seq is not None else range(len(lens))
    one = torch.tensor([0, 1], dtype=torch.int32)
    for r, (n, s) in enumerate(zip(lens, seqs)):
        if n == 0:
            continue
        out[r] = paged_attention_ref(query[r:r + 1].clone(), k_cache, v_cache, one,
                                     torch.tensor([n], dtype=torch.int32), block_tables[s:s + 1], 1, n, scale,
                                     sliding_window=sliding_window, softcap=softcap)[0]
    return out

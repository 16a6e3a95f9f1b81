"""Batch-invariant paged attention (`engine.deterministic`): one query token per row, whether the token comes in a
decode step, a whole prefill or a chunk of one, so a token's attention output is bitwise the same in all three.

Why the default kernels are not: the decode kernel splits the context into a number of parts chosen from the
batch size (`decode_launch.default_num_splits`) and its tile width from the batch too; the prefill kernel holds
16 tokens per tile and its online softmax runs over other tile boundaries; the fused rotary decode kernel folds
the new token in last, from registers. Each is a different summation order for the same token.

Here a token's visible keys [lo, kv_len) (lo: 0, or the window's start) are cut into splits at fixed offsets from
lo: SPLIT_KEYS keys each while the token sees at most MAX_SPLITS * SPLIT_KEYS keys, else the smallest multiple of
SPLIT_KEYS that makes MAX_SPLITS splits enough (`_row_splits`: a function of the token's kv_len and the window
alone). Each split is one online softmax (decode_tiles.attend_tiles: fp32, BLOCK_N-key tiles in increasing key
order from the split's start), the G query heads of a KV head the rows of one tl.dot tile (rows do not interact).
A token with one split normalises and writes its output directly; otherwise every split writes (acc, m, l) to an
fp32 workspace and a second kernel merges them (decode_tiles.merge_partials over a fixed MAX_SPLITS-wide vector,
unused splits masked: the same reduction for every token). Nothing in a token's arithmetic depends on the other
rows, the step's shape, or whether its own key was written in this step (every key is read back from the cache:
rope_kv writes them first).

The launch only distributes that work: the grid's third axis (P programs per (row, KV head), each taking splits
slot, slot + P, ...) follows the batch (more programs at a small batch), the workspace's split axis the longest
context a row of the step can have (its block-table width, a shape: in a CUDA graph the engine's max_model_len,
capped at MAX_SPLITS), and rows go ROW_SPLITS // splits at a time so the workspace stays bounded whatever the
number of rows (a long prefill). A prefill chunk's tokens each read their own context (no reuse across the tokens
of a prefill tile, unlike the default prefill kernel).

CPU: `query_attention_rows`, the torch reference (`paged_attention_ref`) called once per row with that row's own
length, so each row's shapes, and hence its arithmetic, are a function of its position alone.
"""

from __future__ import annotations

import torch

from batchgen.kernels.attention.reference import paged_attention_ref

try:
    import triton
    import triton.language as tl

    from batchgen.kernels.attention.decode_tiles import attend_tiles, merge_partials, store_partials
    from batchgen.kernels.attention.paged_prefill import query_operand
except ImportError:  # installs without Triton (CPU) use query_attention_rows
    triton = None

BLOCK_N = 32  # keys per tile: fixed for every row, step and batch (the invariant); not tuned on a GPU yet
NUM_WARPS = 2
SPLIT_KEYS = 256  # keys per split (a multiple of BLOCK_N); fixed, like MAX_SPLITS: the invariant
MAX_SPLITS = 16  # splits per token at most (a power of two: the merge's vector width)
TARGET_PROGRAMS = 2048  # split programs a launch aims at (spreading only: any value gives the same bits)
ROW_SPLITS = 4096  # (row, split) workspace slots per launch: 4096 x H x D fp32 (64 MiB at Llama-8B's heads)

if triton is not None:
    @triton.jit
    def _row_splits(kv_len, window, SPLIT_KEYS: tl.constexpr, MAX_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """A token's (first visible key, number of splits, keys per split): from kv_len and the window alone."""
        lo = 0
        if HAS_WINDOW:  # the query (position kv_len - 1) sees positions > kv_len - 1 - window
            lo = tl.maximum(kv_len - window, 0)
        blocks = tl.cdiv(kv_len - lo, SPLIT_KEYS)
        size = SPLIT_KEYS * tl.maximum(tl.cdiv(blocks, MAX_SPLITS), 1)
        return lo, tl.maximum(tl.cdiv(kv_len - lo, size), 1), size

    @triton.jit(do_not_specialize=["row0", "num_splits", "stride_bt"])
    def _split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, row_seq_ptr, kv_lens_ptr, block_tables_ptr,
        row0, num_splits, scale, softcap, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kn, stride_kb, stride_kh, stride_bt,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr, MAX_SPLITS: tl.constexpr,
        HAS_ROW_SEQ: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    ):
        """Program (r, h, slot): splits slot, slot + P, ... of row row0 + r, KV head h (workspace: num_splits
        slots per (launch row, KV head))."""
        r = tl.program_id(0)
        t = row0 + r.to(tl.int64)
        h = tl.program_id(1)
        kv_len = tl.load(kv_lens_ptr + t)  # keys the row sees: its position + 1; 0 (a graph's padding row): zeros
        seq = t
        if HAS_ROW_SEQ:
            seq = tl.load(row_seq_ptr + t).to(tl.int64)
        lo, n_splits, size = _row_splits(kv_len, window, SPLIT_KEYS, MAX_SPLITS, HAS_WINDOW)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, D_P)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + t * stride_qt + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [GROUP_P, D_P]
        q = query_operand(q, k_cache_ptr)  # bf16 over an fp8 cache: fp16
        for s in tl.range(tl.program_id(2), n_splits, tl.num_programs(2)):
            start = lo + s * size
            acc, m_i, l_i = attend_tiles(q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, start,
                                         tl.minimum(start + size, kv_len), h, scale, softcap, stride_kn, stride_kb,
                                         stride_kh, d, d_ok, GROUP_P, D_P, BLOCK_SIZE, BLOCK_N, HAS_SOFTCAP)
            if n_splits == 1:  # the whole context: the output itself (an empty row's l is 0: zeros)
                out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
                tl.store(out_ptr + t * stride_ot + (h * GROUP + g)[:, None] * stride_oh + d[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
            else:
                part = (r * tl.num_programs(1) + h) * num_splits + s  # (launch row, KV head, split)
                store_partials(acc, m_i, l_i, acc_ptr, m_ptr, l_ptr, part * GROUP + g, g_ok, d, D_P)

    @triton.jit(do_not_specialize=["row0", "num_splits"])
    def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, kv_lens_ptr, row0, num_splits, window, stride_ot, stride_oh,
                      NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
                      SPLIT_KEYS: tl.constexpr, MAX_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """Program (r, query head): row row0 + r's splits merged in split order (rows with one split: nothing)."""
        r = tl.program_id(0)
        t = row0 + r.to(tl.int64)
        hq = tl.program_id(1)
        _, n_splits, _ = _row_splits(tl.load(kv_lens_ptr + t), window, SPLIT_KEYS, MAX_SPLITS, HAS_WINDOW)
        if n_splits > 1:
            s = tl.arange(0, MAX_SPLITS)
            d = tl.arange(0, D_P)
            part = (r * NUM_KV_HEADS + hq // GROUP) * num_splits + s  # [MAX_SPLITS]
            out = merge_partials(acc_ptr, m_ptr, l_ptr, part * GROUP + hq % GROUP, s < n_splits, d, D_P)
            tl.store(out_ptr + t * stride_ot + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty),
                     mask=d < HEAD_DIM)


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
    """Triton (CUDA, or CPU under TRITON_INTERPRET=1); graph-capturable: every input is read on the device, and
    the launches and the workspace follow shapes only (R, and the block-table width W)."""
    num_rows, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert query.stride(2) == 1 and k_cache.stride(3) == 1 and kv_lens.dtype == torch.int32
    assert SPLIT_KEYS % BLOCK_N == 0 and MAX_SPLITS & (MAX_SPLITS - 1) == 0
    out = torch.empty(num_rows, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_rows == 0:
        return out
    d_p = max(16, triton.next_power_of_2(head_dim))
    # Splits any row can have: its kv_len <= W * block_size (the keys its block-table row can name).
    num_splits = max(1, min(MAX_SPLITS, triton.cdiv(block_tables.shape[1] * block_size, SPLIT_KEYS)))
    rows_per_launch = min(num_rows, max(1, ROW_SPLITS // num_splits))
    slots = min(num_splits, max(1, TARGET_PROGRAMS // (rows_per_launch * num_kv_heads)))
    if num_splits > 1:
        parts = rows_per_launch * num_kv_heads * num_splits * group
        acc = torch.empty(parts, d_p, dtype=torch.float32, device=query.device)
        m = torch.empty(parts, dtype=torch.float32, device=query.device)
        l = torch.empty_like(m)
    else:  # every row has one split: no partials
        acc = m = l = out
    consts = dict(GROUP=group, HEAD_DIM=head_dim, D_P=d_p, SPLIT_KEYS=SPLIT_KEYS, MAX_SPLITS=MAX_SPLITS,
                  HAS_WINDOW=sliding_window is not None)
    for row0 in range(0, num_rows, rows_per_launch):
        rows = min(rows_per_launch, num_rows - row0)
        _split_kernel[(rows, num_kv_heads, slots)](
            query, k_cache, v_cache, out, acc, m, l, row_seq if row_seq is not None else kv_lens, kv_lens,
            block_tables, row0, num_splits, scale, softcap or 1.0, sliding_window or 0,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            GROUP_P=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
            HAS_ROW_SEQ=row_seq is not None, HAS_SOFTCAP=softcap is not None, num_warps=NUM_WARPS, **consts)
        if num_splits > 1:
            _merge_kernel[(rows, num_heads)](acc, m, l, out, kv_lens, row0, num_splits, sliding_window or 0,
                                             out.stride(0), out.stride(1), NUM_KV_HEADS=num_kv_heads, **consts)
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

"""Triton paged prefill attention: ragged query chunks over each sequence's cached context (chunked prefill).

The step's K/V are already in the cache. Work is split into items of up to block_m query tokens of one sequence (a
host-built list with the launch it was cut for, `prefill_launch.PrefillWork`); program (item, kv head, head chunk)
holds block_m tokens x HEADS query heads that share one KV head as the rows of one tile, and streams that sequence's
K/V blocks once for all of them with an online softmax (flash-attention style, in exp2 with log2(e) folded into the
scale), causal by absolute position, with optional sliding window and logit softcap. No padding to the longest
sequence, no mask tensor: only the tiles that some row must not fully see (the diagonal, a window's lower edge)
build a mask; the others run unmasked.

The torch reference is `paged_attention_ref` (same arguments less the work list).
"""

from __future__ import annotations

import torch

from batchgen.kernels.attention.prefill_launch import PrefillWork

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

if triton is not None:
    LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)
    FP16_MAX = tl.constexpr(65504.0)  # fp16's largest finite value: query_operand clamps there

    @triton.jit
    def softcapped(s, softcap):
        """softcap * tanh(s / softcap), with tanh from one exp of a non-positive argument (no overflow)."""
        x = s / softcap
        e = tl.exp(-2.0 * tl.abs(x))
        return softcap * tl.where(x >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e)

    @triton.jit
    def full_dot(a, b):
        """a @ b: bf16 / fp16 / fp8 operands on tensor cores; fp32 operands in IEEE fp32 (FMAs on CUDA cores,
        slower), where Triton's default would round them to TF32 (~1e-3 relative error, measured on the H200:
        an fp32 model's attention would not be fp32). Shared with the decode kernels (kernels/attention/decode_tiles.py)."""
        if a.dtype == tl.float32:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def query_operand(q, cache_ptr):
        """The queries as the attention's dot operand over the K/V cache at cache_ptr: bf16 queries over an fp8
        cache in fp16 (clamped to +-65504, fp16's largest finite value; NaN stays NaN), so that each tile's
        `k.to(q.dtype)` upcasts the cache with one hardware conversion for two values (fp8 -> fp16, exact), where
        fp8 -> bf16 takes three on sm_90 (fp8 -> fp16, then fp16 -> bf16 one value at a time); else q itself.
        p then rounds to fp16 too. Called once a program, where q is loaded (decode_tiles.attend_tiles' callers)."""
        x = q
        if cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
            f = q.to(tl.float32)
            x = tl.where(f > FP16_MAX, FP16_MAX, tl.where(f < -FP16_MAX, -FP16_MAX, f)).to(tl.float16)
        return x

    @triton.jit
    def paged_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, pos, pos_ok, h, stride_kn, stride_kb, stride_kh, d, d_ok,
                      BLOCK_SIZE: tl.constexpr):
        """K and V [BLOCK_N, D_P] of KV head h at token positions pos [BLOCK_N] of one sequence (table_ptr: its
        block-table row), zeros where not pos_ok or past the head dim. Shared with the decode kernels
        (kernels/attention/decode_tiles.py)."""
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        row = block * stride_kn + (pos % BLOCK_SIZE) * stride_kb + h * stride_kh  # [BLOCK_N]
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        return k, v

    @triton.jit
    def attend_tile(acc, m_i, l_i, q, q_pos, n0, kv_end, table_ptr, k_cache_ptr, v_cache_ptr, h, stride_kn, stride_kb,
                    stride_kh, d, d_ok, scale, softcap, window, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, MASKED: tl.constexpr):
        """The K/V tile of keys [n0, n0 + BLOCK_N) folded into the rows' online softmax: acc [ROWS, D_P], m_i (running
        max) and l_i (running sum) [ROWS], scores in log2 units (exp2 of score * log2(e) = exp of the score). MASKED
        False: the caller guarantees every key of the tile below kv_end and visible to every row it stores (causal,
        inside the window), so no mask is built and every score is finite."""
        pos = n0 + tl.arange(0, BLOCK_N)
        k, v = paged_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, pos, pos < kv_end, h, stride_kn, stride_kb,
                             stride_kh, d, d_ok, BLOCK_SIZE)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache: upcast to the queries' dtype (else a no-op)
        if HAS_SOFTCAP:  # the cap applies to the natural-unit score
            s = softcapped(full_dot(q, tl.trans(k)) * scale, softcap) * LOG2E  # [ROWS, BLOCK_N] fp32
        else:
            s = full_dot(q, tl.trans(k)) * (scale * LOG2E)
        if MASKED:
            visible = (pos[None, :] < kv_end) & (pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (q_pos[:, None] - pos[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = m_new  # finite: so is every score of the tile
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)  # 0 while m_i is -inf (nothing seen yet)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + full_dot(p.to(v.dtype), v)
        return acc, m_new, l_i

    # Values that vary from step to step are not specialised on (one build, not one per value class): the block-
    # table width (paged_decode.py), and the work list's address, whose 16-byte alignment depends on where the step's
    # arrays land (measured 2026-12-02: a second build mid-run, ~1 s on an empty Triton cache; its loads are two
    # scalars)
    @triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["work_ptr"])
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
        row_ok = (tok < q_end) & (g < GROUP)  # the rows stored
        head = h * GROUP + g
        q_pos = ctx + tok - q_start  # absolute position of each row's token
        d = tl.arange(0, D_P)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [ROWS, D_P]
        q = query_operand(q, k_cache_ptr)  # bf16 over an fp8 cache: fp16

        first_pos = ctx + tok0 - q_start  # the item's first token's absolute position
        last_pos = tl.minimum(first_pos + BLOCK_M - 1, seq_len - 1)  # its last stored token's
        kv_end = last_pos + 1
        # The keys [kv_start, kv_end), in tiles of BLOCK_N from multiples of BLOCK_N, as three runs (each tile once):
        # [kv_start, full_start) masked: keys the window hides from some rows (none without a window);
        # [full_start, full_end) unmasked: keys every stored row sees (at or before first_pos, and at or after
        #     last_pos - window + 1);
        # [full_end, kv_end) masked: the diagonal, keys some rows are too early to see.
        kv_start = 0
        full_start = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
            full_start = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        full_end = tl.maximum((first_pos + 1) // BLOCK_N * BLOCK_N, full_start)

        table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt  # this sequence's block-table row
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, D_P], dtype=tl.float32)
        for n0 in tl.range(kv_start, full_start, BLOCK_N):
            acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, q_pos, n0, kv_end, table_ptr, k_cache_ptr, v_cache_ptr, h,
                                        stride_kn, stride_kb, stride_kh, d, d_ok, scale, softcap, window,
                                        BLOCK_SIZE, BLOCK_N, HAS_SOFTCAP, HAS_WINDOW, MASKED=True)
        for n0 in tl.range(full_start, full_end, BLOCK_N):
            acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, q_pos, n0, kv_end, table_ptr, k_cache_ptr, v_cache_ptr, h,
                                        stride_kn, stride_kb, stride_kh, d, d_ok, scale, softcap, window,
                                        BLOCK_SIZE, BLOCK_N, HAS_SOFTCAP, HAS_WINDOW, MASKED=False)
        for n0 in tl.range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, q_pos, n0, kv_end, table_ptr, k_cache_ptr, v_cache_ptr, h,
                                        stride_kn, stride_kb, stride_kh, d, d_ok, scale, softcap, window,
                                        BLOCK_SIZE, BLOCK_N, HAS_SOFTCAP, HAS_WINDOW, MASKED=True)
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
    work: PrefillWork,  # the step's work list (any subset of it: only those tokens are written) and its launch
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,  # [T, H, D]; rows outside `work` are left as they are
) -> torch.Tensor:
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    heads = min(triton.next_power_of_2(group), 4)
    launch = work.launch  # the block_m the items were cut with: the kernel's, never another
    rows = launch.block_m * heads
    assert rows >= 16 and rows & (rows - 1) == 0, "a tile's rows: a power of two (tl.arange), >= 16 (tl.dot)"
    assert work.items.dtype == torch.int32 and work.items.device == query.device and work.items.shape[-1] == 2
    assert k_cache.stride(3) == 1 and query.stride(2) == 1
    out = torch.empty_like(query) if out is None else out
    if work.items.shape[0] == 0:
        return out
    grid = (work.items.shape[0], num_kv_heads, triton.cdiv(group, heads))
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, work.items, query_start_loc, seq_lens, block_tables,
        scale, softcap or 1.0, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEADS=heads, HEAD_DIM=head_dim, D_P=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        HAS_SOFTCAP=softcap is not None, HAS_WINDOW=sliding_window is not None,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return out

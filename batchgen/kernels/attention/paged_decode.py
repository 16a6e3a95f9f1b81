"""Triton paged decode attention: one query token per sequence, K/V read from the paged cache.

Split-K over the context: program (seq, kv_head, split) (or (kv_head, seq, split): DecodeLaunch.heads_first)
streams its slice of the sequence's K/V once for all G query heads that share that KV head (GQA), keeping an
online softmax; a second kernel merges the splits. The launch (splits, tile, warps, stages, those
options) comes from `default_launch` (kernels/attention/decode_launch.py: a measured table, else a heuristic) unless the
caller gives one. With one split (enough sequences to fill the GPU) the split kernel normalises and writes the
output itself, and no merge kernel runs. The grid depends only on (num_seqs, num_kv_heads, NUM_SPLITS)
and every piece of metadata is read from device tensors, so a step can be captured in a CUDA graph and
replayed with new contents. A sequence with seq_len == 0 (a padding row of a graph bucket) gets zeros.

Gemma2/Gemma3 layers: `sliding_window` W (a query at position p sees keys p - W < k <= p, as the prefill kernel
and transformers' sliding masks) narrows every split's range to the window, so K/V outside it are never read;
`softcap` c maps each score s to c * tanh(s / c) before the softmax.

`paged_decode_rope_attention` also does rope_kv's work (kernels/attention/rope_kv.py) in the same kernel, saving a
launch per layer: queries are rotated as they are loaded from the QKV projection, and the program whose
split holds the new token rotates its key, writes key and value to the token's cache slot, and attends to
them from registers (no program reads that slot in this step, so the write races with nothing). With a
`QKNorm` (Qwen3, Gemma3) each query head and the new key are first RMS-normalised over the head dim, with
rope_kv's rounding (the same Triton helpers: rope_kv.qk_norm_rounded, then rotate_rounded) and its fixed order of
the fp32 sum of squares (rope_kv.row_sums: the same bits for power-of-two head dims); the values are not
normalised.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from batchgen.kernels.attention.decode_launch import DecodeLaunch, default_launch  # noqa: F401 (callers import it from here)
from batchgen.kernels.attention.decode_tiles import (attend_tiles, fold_new_key, merge_partials, normed_rotated,
                                          projection_load, rope_tables, split_program, store_partials)
from batchgen.kernels.fp8.quant import (ActQuant, QuantizedActs, group_quant_buffers, quantize_store_heads,
                                       quantize_store_row)
from batchgen.kernels.attention.paged_prefill import query_operand
from batchgen.kernels.attention.rope_kv import QKNorm, as_cached, rotate_rounded
from batchgen.kernels.fp8.splitk_common import TL_DTYPES, SplitKPartials

MAX_GRID_Y = 65535  # CUDA's limit on a launch grid's y (and z) dimension

# heads_first: one compiled kernel for both grid orders; stride_bt: an eager step's block tables are as wide as
# its longest sequence needs (1, a multiple of 16 or neither), which would otherwise build a kernel for each case
@triton.jit(do_not_specialize=["heads_first", "stride_bt"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    acc_ptr, m_ptr, l_ptr, out_ptr,
    cos_ptr, sin_ptr, slot_ptr,  # FUSE_ROPE only
    qk_norm_ptr, norm_eps,  # HAS_QK_NORM only: QKNorm's [2, HEAD_DIM] weights (q row, k row) and eps
    qkv_bias_ptr, stride_qs,  # QKV_SPLITS only: the split-K GEMM's bias (HAS_QKV_BIAS) and its split stride
    oq_ptr, os_ptr, stride_oqb, stride_osb, stride_osg, scale_ub,  # OUT_GROUP only: the quantised output
    scale, softcap, window, heads_first,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_cs,
    stride_kn, stride_kb, stride_kh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FUSE_ROPE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_QK_NORM: tl.constexpr, QK_UNIT_OFFSET: tl.constexpr,
    QKV_SPLITS: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, ACT_DTYPE: tl.constexpr, OUT_GROUP: tl.constexpr,
    HAS_UB: tl.constexpr, LOG2_HALF_D: tl.constexpr,
):
    b, h, num_kv_heads, s, seq_len, start, end, chunk = split_program(heads_first, seq_lens_ptr, window, NUM_SPLITS,
                                                                      BLOCK_N, HAS_WINDOW)

    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D_P)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_rows = q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh
    q_mask = g_mask[:, None] & d_mask[None, :]
    if FUSE_ROPE:  # q_ptr is the QKV projection [B, (H + 2 Hkv) D] (or its split-K partials [QKV_SPLITS, B, ...])
        partner, sign, cos, sin = rope_tables(cos_ptr, sin_ptr, b, stride_cs, d, d_mask, HEAD_DIM)
        end = tl.minimum(end, seq_len - 1)
        # The new token's K/V, loaded before the loop so their latency hides behind it (only the program
        # whose split holds the new position uses them; -1 for an empty row: none does, nothing is written).
        new_pos = seq_len - 1
        has_new = (new_pos >= start) & (new_pos < start + chunk)
        row = q_ptr + b * stride_qb
        q_cols = (h * GROUP + g)[:, None] * HEAD_DIM  # [GROUP_P, 1]: the group's query heads
        k_col = (GROUP * num_kv_heads + h) * HEAD_DIM
        new_mask = d_mask & has_new
        x = projection_load(row, q_cols + d[None, :], q_mask, stride_qs, qkv_bias_ptr, QKV_SPLITS, HAS_QKV_BIAS,
                            ACT_DTYPE)  # [GROUP_P, D_P]
        xp = projection_load(row, q_cols + partner[None, :], q_mask, stride_qs, qkv_bias_ptr, QKV_SPLITS,
                             HAS_QKV_BIAS, ACT_DTYPE)
        kx = projection_load(row, k_col + d, new_mask, stride_qs, qkv_bias_ptr, QKV_SPLITS, HAS_QKV_BIAS, ACT_DTYPE)
        kxp = projection_load(row, k_col + partner, new_mask, stride_qs, qkv_bias_ptr, QKV_SPLITS, HAS_QKV_BIAS,
                              ACT_DTYPE)
        if HAS_QK_NORM:  # Qwen3 / Gemma3: each q row (a query head) and the key RMS-normalised, then rotated
            q = normed_rotated(x, xp, cos[None, :], sin[None, :], sign[None, :], qk_norm_ptr, d, partner, norm_eps,
                               HEAD_DIM, QK_UNIT_OFFSET, LOG2_HALF_D)  # [GROUP_P, D_P]
            k_new = tl.reshape(normed_rotated(kx[None, :], kxp[None, :], cos[None, :], sin[None, :], sign[None, :],
                                              qk_norm_ptr + HEAD_DIM, d, partner, norm_eps, HEAD_DIM, QK_UNIT_OFFSET,
                                              LOG2_HALF_D), [D_P])
        else:
            q = rotate_rounded(x, xp, cos[None, :], sin[None, :], sign[None, :])  # [GROUP_P, D_P]
            k_new = rotate_rounded(kx, kxp, cos, sin, sign)
        k_new = as_cached(k_new, k_cache_ptr)  # as stored: an fp8 cache's rounding is attended to from registers
        v_new = as_cached(projection_load(row, k_col + num_kv_heads * HEAD_DIM + d, new_mask, stride_qs,
                                          qkv_bias_ptr, QKV_SPLITS, HAS_QKV_BIAS, ACT_DTYPE), v_cache_ptr)
        slot = tl.load(slot_ptr + b, mask=has_new, other=0).to(tl.int64)  # = block * BLOCK_SIZE + offset
    else:
        q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)  # [GROUP_P, D_P]

    q = query_operand(q, k_cache_ptr)  # bf16 over an fp8 cache: fp16, so the new key's p rounds as the tiles' do
    acc, m_i, l_i = attend_tiles(q, k_cache_ptr, v_cache_ptr, block_tables_ptr + b * stride_bt, start, end, h,
                                 scale, softcap, stride_kn, stride_kb, stride_kh, d, d_mask, GROUP_P, D_P,
                                 BLOCK_SIZE, BLOCK_N, HAS_SOFTCAP)

    if FUSE_ROPE:
        if has_new:
            tl.store(k_cache_ptr + slot * stride_kb + h * stride_kh + d, k_new, mask=d_mask)
            tl.store(v_cache_ptr + slot * stride_kb + h * stride_kh + d, v_new, mask=d_mask)
            score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale  # [GROUP_P]
            acc, m_i, l_i = fold_new_key(score, v_new.to(q.dtype)[None, :], acc, m_i, l_i, softcap, HAS_SOFTCAP)

    if NUM_SPLITS == 1:  # the whole context is here: the output itself (an empty sequence's l is 0: zeros)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if OUT_GROUP > 0:  # quantised for the output GEMM (D_P == HEAD_DIM, a multiple of OUT_GROUP)
            quantize_store_heads(out.to(ACT_DTYPE).to(tl.float32), h * GROUP + g, g_mask, oq_ptr + b * stride_oqb,
                                 os_ptr + b * stride_osb, stride_osg, scale_ub, HAS_UB, GROUP_P, D_P, OUT_GROUP)
        else:
            tl.store(out_ptr + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        return
    # Only the GROUP real query rows are stored (tl.dot pads the group to >= 16 rows; storing the padding
    # would write up to 4x the partials the merge reads).
    part = (b * num_kv_heads + h) * NUM_SPLITS + s  # index of this (seq, kv head, split)
    store_partials(acc, m_i, l_i, acc_ptr, m_ptr, l_ptr, part * GROUP_P + g, g_mask, d, D_P)


@triton.jit
def _decode_merge_kernel(
    acc_ptr, m_ptr, l_ptr, out_ptr,
    stride_ob, stride_oh,
    oq_ptr, os_ptr, stride_oqb, stride_osb, stride_osg, scale_ub,  # OUT_GROUP only: the quantised output
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr, NUM_SPLITS: tl.constexpr, ACT_DTYPE: tl.constexpr, OUT_GROUP: tl.constexpr,
    HAS_UB: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // GROUP
    g = hq % GROUP
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_P)
    part = (b * NUM_KV_HEADS + h) * NUM_SPLITS + s  # [S]
    out = merge_partials(acc_ptr, m_ptr, l_ptr, part * GROUP_P + g, s < NUM_SPLITS, d, D_P)
    if OUT_GROUP > 0:  # quantised for the output GEMM (D_P == HEAD_DIM, a multiple of OUT_GROUP)
        quantize_store_row(out.to(ACT_DTYPE).to(tl.float32), hq * HEAD_DIM, tl.num_programs(1) * HEAD_DIM,
                           oq_ptr + b * stride_oqb, os_ptr + b * stride_osb, stride_osg, scale_ub, HAS_UB, D_P,
                           OUT_GROUP)
    else:
        tl.store(out_ptr + b * stride_ob + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D] one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32 (0 for padding rows)
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,  # None (and below): default_launch's
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | None = None,  # keys within the last `sliding_window` positions only (Gemma2/3 layers)
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma2)
    launch: DecodeLaunch | None = None,  # None: default_launch with num_splits
) -> torch.Tensor:  # [B, H, D]
    assert query.stride(2) == 1
    if launch is not None and (num_splits or block_n or num_warps or num_stages is not None):
        raise ValueError("paged_decode_attention: a whole `launch`, or num_splits / block_n / num_warps / num_stages")
    num_kv_heads = k_cache.shape[2]
    launch = launch or default_launch(query.shape[0], num_kv_heads, k_cache.shape[3], num_splits,
                                      group=query.shape[1] // num_kv_heads, kv_element_bytes=k_cache.element_size())
    if block_n or num_warps or num_stages is not None:  # a caller's own tile (tests, benches)
        launch = replace(launch, block_n=block_n or launch.block_n, num_warps=num_warps or launch.num_warps,
                         num_stages=num_stages if num_stages is not None else launch.num_stages)
    return _launch(query, query.shape[1], None, k_cache, v_cache, block_tables, seq_lens, scale, launch,
                   sliding_window, softcap)


def paged_decode_rope_attention(
    qkv: torch.Tensor | SplitKPartials,  # [B, (H + 2 Hkv) D] the QKV projection (q, k, v heads), or its partials
    cos: torch.Tensor,  # [B, D] rotary cos/sin at each sequence's position, in the activation dtype
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,  # [B] the new token's cache slot (block * block_size + offset)
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous; the new K/V are written here
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [B] int32, the new token included (0 for padding rows)
    scale: float,
    num_heads: int,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    launch: DecodeLaunch | None = None,  # None: default_launch with num_splits
    qk_norm: QKNorm | None = None,  # Qwen3 / Gemma3: each q and k head RMS-normalised before the rotation
    quant: ActQuant | None = None,  # the output GEMM's input quantisation, done here where the launch can
) -> torch.Tensor | QuantizedActs:  # [B, H, D], or [B, H D] quantised
    """rope_kv (its q/k norm included) followed by paged_decode_attention, in one kernel. FP8 hand-offs
    (quant/fusion.py): qkv may be a split-K GEMM's unsummed partials (summed as its reduction kernel would,
    as they are loaded), and with `quant` the output comes back as
    QuantizedActs, bit for bit as quantize_groups would quantise it, where each head is whole quantisation groups
    (head_dim a power of two and a multiple of quant.group) and the launch has one KV head a program; else as a
    tensor, for the GEMM to quantise."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0
    assert isinstance(qkv, SplitKPartials) or qkv.stride(1) == 1
    assert cos.stride(1) == 1 and sin.stride() == cos.stride() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert qk_norm is None or (qk_norm.weights.shape == (2, head_dim) and qk_norm.weights.is_contiguous())
    if launch is not None and num_splits:
        raise ValueError("paged_decode_rope_attention: a whole `launch`, or num_splits")
    launch = launch or default_launch(qkv.shape[0], num_kv_heads, head_dim, num_splits,
                                      group=num_heads // num_kv_heads, kv_element_bytes=k_cache.element_size())
    return _launch(qkv, num_heads, (cos, sin, slot_mapping), k_cache, v_cache, block_tables, seq_lens, scale,
                   launch, sliding_window, softcap, qk_norm, quant)


def _launch(q_src, num_heads, rope, k_cache, v_cache, block_tables, seq_lens, scale, launch: DecodeLaunch,
            sliding_window=None, softcap=None, qk_norm: QKNorm | None = None,
            quant: ActQuant | None = None) -> torch.Tensor | QuantizedActs:
    num_seqs = q_src.shape[0]
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_splits, block_n = launch.num_splits, launch.block_n
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    if launch.mma:
        group_p = max(16, group_p)  # tl.dot needs >= 16 rows
    d_p = max(16, triton.next_power_of_2(head_dim))
    assert k_cache.stride(3) == 1 and num_splits & (num_splits - 1) == 0
    partials = q_src if isinstance(q_src, SplitKPartials) else None
    act_dtype = q_src.dtype if partials is None else partials.dtype
    src = q_src if partials is None else partials.part  # [B, N], or [S, B, N] contiguous
    quantise = quant is not None and d_p == head_dim and head_dim % quant.group == 0
    dev = src.device
    if quantise:  # the kernels write the quantised output only
        oq, oscale = group_quant_buffers(num_seqs, num_heads * head_dim, quant.group, dev)
        out = oq  # unused
    else:
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=act_dtype, device=dev)
        oq = oscale = out  # unused
    if num_splits == 1:  # unused by the kernel, which writes `out` directly
        acc = m = l = out
    else:
        acc = torch.empty(num_seqs * num_kv_heads * num_splits * group_p * d_p, dtype=torch.float32, device=dev)
        m = torch.empty(num_seqs * num_kv_heads * num_splits * group_p, dtype=torch.float32, device=dev)
        l = torch.empty_like(m)
    if rope is None:
        cos = sin = slots = seq_lens  # unused
        stride_qb, stride_qh, stride_cs = q_src.stride(0), q_src.stride(1), 0
    else:
        cos, sin, slots = rope
        stride_qb, stride_qh, stride_cs = src.stride(-2), head_dim, cos.stride(0)
    options = {"num_warps": launch.num_warps}
    if launch.num_stages is not None:
        options["num_stages"] = launch.num_stages
    quant_args = (oq, oscale, oq.stride(0), oscale.stride(0), oscale.stride(1),
                  (quant.scale_ub or 0.0) if quantise else 0.0)
    quant_flags = dict(ACT_DTYPE=TL_DTYPES[act_dtype], OUT_GROUP=quant.group if quantise else 0,
                       HAS_UB=quantise and quant.scale_ub is not None)
    # KV heads first puts the sequences on grid axis y, which CUDA caps at 65,535: a larger batch goes sequences first
    heads_first = launch.heads_first and num_seqs <= MAX_GRID_Y
    grid = (num_kv_heads, num_seqs, num_splits) if heads_first else (num_seqs, num_kv_heads, num_splits)
    has_bias = partials is not None and partials.bias is not None
    _decode_split_kernel[grid](
        src, k_cache, v_cache, block_tables, seq_lens, acc, m, l, out, cos, sin, slots,
        *(qk_norm[:2] if qk_norm is not None else (src, 0.0)),
        partials.bias if has_bias else src, src.stride(0) if partials is not None else 0, *quant_args,
        scale, softcap or 1.0, sliding_window or 0, int(heads_first), stride_qb, stride_qh, out.stride(0),
        out.stride(1), stride_cs,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, D_P=d_p, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, FUSE_ROPE=rope is not None, HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=sliding_window is not None, HAS_QK_NORM=qk_norm is not None,
        QK_UNIT_OFFSET=qk_norm is not None and qk_norm.unit_offset,
        QKV_SPLITS=0 if partials is None else src.shape[0], HAS_QKV_BIAS=has_bias,
        LOG2_HALF_D=(d_p // 2).bit_length() - 1, **quant_flags, **options,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            acc, m, l, out, out.stride(0), out.stride(1), *quant_args,
            NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, D_P=d_p,
            NUM_SPLITS=num_splits, **quant_flags,
        )
    return QuantizedActs(oq, oscale, quant, act_dtype) if quantise else out

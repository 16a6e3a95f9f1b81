"""Rotary embedding of the step's queries and keys fused with the K/V cache write (Triton), and its reference.

Input: the fused QKV projection of T tokens, [T, (H + 2 * Hkv) * D] (q heads, then k heads, then v heads).
Output: the rotated queries [T, H, D]; the rotated keys and the values go straight into the paged cache at
each token's slot; no intermediate K/V tensors. One program per (tile of BLOCK_T tokens, head), each half of the
head a [BLOCK_T, head_dim / 2] tile; BLOCK_T and the warps come from `rope_kv_launch` (4-token tiles below 256
tokens, 16-token tiles from there). A token's results do not depend on its tile (the q/k
norm's sum of squares is a fixed tree of adds, not tl.sum, whose order follows the launch's layout), so the step's
token count changes no bits of a row: engine.deterministic relies on that.

Optionally each q and k head is RMS-normalised first (`QKNorm`: Qwen3's and Gemma3's q_norm / k_norm, over the
head dim, each with its module's rounding).
Rotation as transformers' `apply_rotary_pos_emb` (rotate-half layout, cos/sin [T, D] in the activation dtype):
x * cos + rotate_half(x) * sin, with each product and the sum rounded to the activation dtype, as the
eager model rounds them; with `rotate_fp32` (OLMo2, whose rotary tables stay fp32) the rotation is taken in
fp32 and rounded once.

On CUDA decode steps (without rotate_fp32) the decode attention kernel does this work itself
(kernels/attention/paged_decode.py: paged_decode_rope_attention, through the same rotate_rounded and qk_norm_rounded);
this kernel serves packed steps, the deterministic path and OLMo2.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from batchgen.kernels.attention.reference import write_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None


class QKNorm(NamedTuple):
    """Per-head RMSNorm of q and k before the rotation."""

    weights: torch.Tensor  # [2, D] contiguous: the q norm's weight, then the k norm's
    eps: float  # both norms' (the decoders check that they agree)
    # False: Qwen3's rounding (the normalised row rounded, then times w); True: Gemma3's ((1 + w) in fp32, the
    # product rounded once), as kernels/norm/rmsnorm.py's unit_offset
    unit_offset: bool = False


if triton is not None:
    @triton.jit
    def as_cached(x, cache_ptr):
        """x as the K/V cache at cache_ptr stores it: rounded to the cache's dtype; an fp8 cache (scale 1)
        saturates at +-448.0 (FP8_MAX) first, as paged_attention_ref.as_cached does."""
        if cache_ptr.dtype.element_ty == tl.float8e4nv:  # where, not min / max: a NaN stays NaN, as torch's clamp
            f = x.to(tl.float32)
            x = tl.where(f > 448.0, 448.0, tl.where(f < -448.0, -448.0, f))
        return x.to(cache_ptr.dtype.element_ty)

    @triton.jit
    def rotate_rounded(x, x_partner, cos, sin, sign):
        """x * cos + rotate_half(x) * sin, each product and the sum rounded to x's dtype as the eager model
        rounds them; rotate_half(x) = sign * x_partner (the other half: -x2 for the first half, x1 for the
        second). cos/sin in fp32. The one rotary formula of every kernel (paged_decode.py too)."""
        a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
        b = (x_partner.to(tl.float32) * sin).to(x.dtype).to(tl.float32)
        return (a + sign * b).to(x.dtype)

    @triton.jit
    def qk_norm_rounded(x, rstd, w, UNIT_OFFSET: tl.constexpr):
        """A QKNorm of x (activation dtype) given its row's rstd and the weight w (fp32), rounded as the eager
        module: Qwen3's w * (x * rstd) with the normalised value rounded first, or (UNIT_OFFSET) Gemma3's
        (x * rstd) * (1 + w) in fp32, rounded once. The one q/k norm formula of every kernel (paged_decode.py
        too)."""
        f = x.to(tl.float32)
        if UNIT_OFFSET:
            y = (f * rstd) * (1.0 + w)
        else:
            y = w * (f * rstd).to(x.dtype).to(tl.float32)
        return y.to(x.dtype)

    @triton.jit
    def row_sums(x, LOG2_WIDTH: tl.constexpr):
        """Each row's sum of x [R, 2 ** LOG2_WIDTH] by a fixed pairwise tree of elementwise adds ((x0 + x1) +
        (x2 + x3)) + ...: the same bits whatever the tile's row count and the compiler's layout (tl.sum's order
        follows the layout, which follows the launch: a row's q/k norm would depend on the step's token count)."""
        for _ in tl.static_range(LOG2_WIDTH):
            a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
            x = a + b
        return tl.reshape(x, [x.shape[0]])

    # the step's token count is not specialised on (divisible by 16 or not: one build, not two; a run of 2026-12-02
    # built the second mid-run); it only bounds the last tile's rows
    @triton.jit(do_not_specialize=["num_tokens"])
    def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                        qk_norm_ptr, norm_eps, num_tokens,
                        stride_qkv, stride_cs,
                        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        HALF_P: tl.constexpr, LOG2_HALF_P: tl.constexpr, BLOCK_T: tl.constexpr,
                        HAS_QK_NORM: tl.constexpr, QK_UNIT_OFFSET: tl.constexpr, ROTATE_FP32: tl.constexpr):
        # tile [BLOCK_T tokens, HALF_P]: each token's first half (x1) and second half (x2) of head h
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.program_id(1)
        half = HEAD_DIM // 2
        i = tl.arange(0, HALF_P)
        t_ok = t < num_tokens  # the last tile's rows past the step's tokens: loaded as 0, never stored
        m = t_ok[:, None] & (i < half)[None, :]
        src = qkv_ptr + t[:, None] * stride_qkv + h * HEAD_DIM + i[None, :]
        x1 = tl.load(src, mask=m, other=0.0)
        x2 = tl.load(src + half, mask=m, other=0.0)
        dtype = x1.dtype
        slot = tl.load(slot_ptr + t, mask=t_ok, other=0).to(tl.int64)
        kv_row = (slot * (NUM_KV_HEADS * HEAD_DIM))[:, None] + i[None, :]
        if h < NUM_HEADS + NUM_KV_HEADS:
            if HAS_QK_NORM:  # per-head RMSNorm before the rotation (Qwen3, Gemma3), rounded as its eager module
                w_row = qk_norm_ptr + (h >= NUM_HEADS).to(tl.int32) * HEAD_DIM  # row 0: q weight, row 1: k
                f1 = x1.to(tl.float32)
                f2 = x2.to(tl.float32)
                # one rstd per (token, head) row; masked columns add exact zeros
                rstd = tl.rsqrt(row_sums(f1 * f1 + f2 * f2, LOG2_HALF_P) / HEAD_DIM + norm_eps)[:, None]
                w1 = tl.load(w_row + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
                w2 = tl.load(w_row + half + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
                x1 = qk_norm_rounded(x1, rstd, w1, QK_UNIT_OFFSET)
                x2 = qk_norm_rounded(x2, rstd, w2, QK_UNIT_OFFSET)
            cs = t[:, None] * stride_cs + i[None, :]
            c1 = tl.load(cos_ptr + cs, mask=m, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + cs + half, mask=m, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + cs, mask=m, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + cs + half, mask=m, other=0.0).to(tl.float32)
            if ROTATE_FP32:  # the compiler may contract a product and the sum into an FMA: at most 1 fp32 ulp
                o1 = (x1.to(tl.float32) * c1 - x2.to(tl.float32) * s1).to(dtype)
                o2 = (x2.to(tl.float32) * c2 + x1.to(tl.float32) * s2).to(dtype)
            else:
                o1 = rotate_rounded(x1, x2, c1, s1, -1.0)
                o2 = rotate_rounded(x2, x1, c2, s2, 1.0)
            # one name per pointer type: the GPU compiler refuses a variable whose type differs between the two
            # branches of a runtime `if` (an fp8 cache's pointers are not the queries')
            if h < NUM_HEADS:
                q_dst = q_out_ptr + (t[:, None] * NUM_HEADS + h) * HEAD_DIM + i[None, :]
                tl.store(q_dst, o1, mask=m)
                tl.store(q_dst + half, o2, mask=m)
            else:
                k_dst = k_cache_ptr + kv_row + (h - NUM_HEADS) * HEAD_DIM
                tl.store(k_dst, as_cached(o1, k_cache_ptr), mask=m)
                tl.store(k_dst + half, as_cached(o2, k_cache_ptr), mask=m)
        else:
            v_dst = v_cache_ptr + kv_row + (h - NUM_HEADS - NUM_KV_HEADS) * HEAD_DIM
            tl.store(v_dst, as_cached(x1, v_cache_ptr), mask=m)
            tl.store(v_dst + half, as_cached(x2, v_cache_ptr), mask=m)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate_fp32: bool = False) -> torch.Tensor:
    if rotate_fp32:
        return _rotate(x.float(), cos.float(), sin.float()).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def rope_kv_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                qk_norm: QKNorm | None = None, rotate_fp32: bool = False) -> torch.Tensor:
    """qkv: [T, (H + 2 Hkv) D]; cos/sin: [T, D]; caches: [num_blocks, block_size, Hkv, D]; qk_norm: optional
    per-head RMSNorm before the rotation. Returns q [T, H, D]."""
    from batchgen.kernels.norm.rmsnorm import rmsnorm_ref

    num_tokens, head_dim = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    if qk_norm is not None:
        weights, eps, unit = qk_norm
        q, k = rmsnorm_ref(q, weights[0], eps, unit_offset=unit), rmsnorm_ref(k, weights[1], eps, unit_offset=unit)
    q, k = _rotate(q, cos, sin, rotate_fp32), _rotate(k, cos, sin, rotate_fp32)
    write_kv(k_cache, v_cache, k, v.reshape(num_tokens, num_kv_heads, head_dim), slot_mapping)
    return q


def rope_kv_launch(num_tokens: int) -> tuple[int, int]:
    """(BLOCK_T, num_warps) for a step of `num_tokens` tokens. Measured on the H200 (bench/rope_kv_sweep.py,
    Llama-8B heads, 2026-12-02): 16-token tiles on 8 warps were the fastest at 256 and 8,192 tokens and within
    0.4 % of the fastest at 2,048 (3.45 / 15.56 / 55.3 us a call against the one-token-a-program launch's 8.96 /
    62.9 / 240: 2.6-4.3x); below 256 tokens (the deterministic path's and OLMo2's decode steps) 4-token tiles on
    one warp, so that a small step still spreads over the SMs (at 256 tokens 4.16 us, 2.2x the old launch; smaller
    steps not measured). Any launch gives the same bits: a token's row never depends on its tile."""
    if num_tokens < 256:
        return 4, 1
    return 16, 8


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
            qk_norm: QKNorm | None = None, use_triton: bool = True,
            rotate_fp32: bool = False, *, block_tokens: int | None = None, num_warps: int | None = None
            ) -> torch.Tensor:
    """`block_tokens` / `num_warps` (benchmarks only: bench/rope_kv_sweep.py) replace rope_kv_launch's."""
    if not use_triton:
        return rope_kv_ref(qkv, cos, sin, slot_mapping, k_cache, v_cache, num_heads, num_kv_heads, qk_norm,
                           rotate_fp32)
    num_tokens, head_dim = qkv.shape[0], cos.shape[-1]
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride() and k_cache.is_contiguous()
    assert head_dim % 2 == 0 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert qk_norm is None or (qk_norm[0].shape == (2, head_dim) and qk_norm[0].is_contiguous())
    block_t, warps = rope_kv_launch(num_tokens)
    block_t, warps = block_tokens or block_t, num_warps or warps
    half_p = triton.next_power_of_2(head_dim // 2)
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(triton.cdiv(num_tokens, block_t), num_heads + 2 * num_kv_heads)](
        qkv, cos, sin, slot_mapping, q, k_cache, v_cache,
        *(qk_norm[:2] if qk_norm is not None else (qkv, 0.0)), num_tokens, qkv.stride(0), cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HALF_P=half_p, LOG2_HALF_P=half_p.bit_length() - 1, BLOCK_T=block_t, HAS_QK_NORM=qk_norm is not None,
        QK_UNIT_OFFSET=qk_norm is not None and qk_norm.unit_offset,
        ROTATE_FP32=rotate_fp32, num_warps=warps)
    return q

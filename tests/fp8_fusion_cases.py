"""Checks of the FP8 hand-offs (quant/fusion.py) at the kernel level, shared by the interpreter scripts (CPU,
tiny shapes) and the GPU tests (Llama-8B shapes): each fused kernel against the unfused kernels it replaces,
compared bit for bit (the fp8 bytes as uint8, the fp32 scales and their strides, the residual stream)."""

from __future__ import annotations

import torch

from batchgen.kernels.fp8.quant import ActQuant, QuantizedActs, quantize_groups, quantize_weight
from batchgen.kernels.norm.gated_act import gated_act
from batchgen.kernels.norm.rmsnorm import rmsnorm
from batchgen.kernels.fp8.splitk_common import SplitKPartials


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors of one dtype and shape (torch.equal on floats calls -0.0 and 0.0 equal)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def assert_quantized_as(got: QuantizedActs, x: torch.Tensor, quant: ActQuant, what) -> None:
    """`got` is quantize_groups(x, quant.group, quant.scale_ub), bit for bit, in its layout."""
    q, scale = quantize_groups(x, quant.group, quant.scale_ub)
    assert got.quant == quant and got.dtype == x.dtype, what
    assert same_bits(got.xq, q), (what, (got.xq.float() != q.float()).sum().item())
    assert same_bits(got.scale, scale) and got.scale.stride() == scale.stride(), what


def _rows(rows: int, cols: int, dtype: torch.dtype, device, g: torch.Generator, amp: float = 3.0) -> torch.Tensor:
    """[rows, cols] normal * amp with row 1 (if any) all zeros (the quantiser's zero-row guard; its norm stays finite)."""
    x = torch.randn(rows, cols, generator=g) * amp
    if rows > 1:
        x[1] = 0.0
    return x.to(device, dtype)


def check_norm(device, dtype: torch.dtype, rows: int, cols: int, group: int, scale_ub: float | None, kind: str,
               residual: bool, x_scale: float | None, splits: int, bias: bool, seed: int = 0) -> None:
    """rmsnorm with `quant` (and, splits > 0, over a split-K GEMM's partials) against the unfused kernels:
    reduce_splits, then rmsnorm, then quantize_groups. Also the partials alone (step 2 without a quantised
    output) against reduce_splits then rmsnorm."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(cols, generator=g) * 0.3 + (0.0 if kind == "rms_unit_offset" else 1.0)).to(device, dtype)
    res = _rows(rows, cols, dtype, device, g) if residual else None
    flags = dict(unit_offset=kind == "rms_unit_offset", weight_fp32=kind == "rms_fp32_weight", x_scale=x_scale)
    if splits:
        part = (torch.randn(splits, rows, cols, generator=g) * 2).to(device)
        if rows > 1:  # a zero row (the quantiser's zero-row guard)
            part[:, 1] = 0.0
        b = (torch.randn(cols, generator=g) * 0.1).to(device, dtype) if bias else None
        x = SplitKPartials(part, b, dtype)
    else:
        x = _rows(rows, cols, dtype, device, g)
    what = (dtype, rows, cols, group, scale_ub, kind, residual, x_scale, splits, bias)
    quant = ActQuant(group, scale_ub)
    for q in (quant, None) if splits else (quant,):
        res_ref, res_got = (res.clone(), res.clone()) if residual else (None, None)
        plain = x.reduce() if splits else x
        ref = rmsnorm(plain, weight, 1e-5, residual=res_ref, **flags)
        got = rmsnorm(x, weight, 1e-5, residual=res_got, quant=q, **flags)
        assert not residual or same_bits(res_got, res_ref), what
        if q is None:
            assert same_bits(got, ref), what
        else:
            assert_quantized_as(got, ref, quant, what)


def check_gated(device, dtype: torch.dtype, rows: int, inter: int, group: int, scale_ub: float | None,
                activation: str, seed: int = 0) -> None:
    """gated_act with `quant` against gated_act, then quantize_groups."""
    g = torch.Generator().manual_seed(seed)
    x = _rows(rows, 2 * inter, dtype, device, g, amp=2.0)
    quant = ActQuant(group, scale_ub)
    got = gated_act(x, activation, quant=quant)
    assert_quantized_as(got, gated_act(x, activation), quant, (dtype, rows, inter, group, scale_ub, activation))


def check_gemm_reads_quantized(device, dtype: torch.dtype, m: int, n: int, k: int, group: int, path: str,
                               seed: int = 0) -> None:
    """fp8_linear over QuantizedActs (a fused norm's output) equals fp8_linear over the norm's output tensor on
    `path` (the caller makes choose_path take it), bias included; split-K also unreduced."""
    from batchgen.kernels.fp8.gemm import fp8_linear

    g = torch.Generator().manual_seed(seed)
    w, s = quantize_weight(torch.randn(n, k, generator=g) * 0.05, group, group)
    w, s = w.to(device), s.to(device)
    bias = (torch.randn(n, generator=g) * 0.1).to(device, dtype)
    x, norm_w = _rows(m, k, dtype, device, g), (torch.randn(k, generator=g) * 0.3 + 1.0).to(device, dtype)
    acts = rmsnorm(x, norm_w, 1e-5, quant=ActQuant(group))
    ref = fp8_linear(rmsnorm(x, norm_w, 1e-5), w, s, group, group, bias)
    assert same_bits(fp8_linear(acts, w, s, group, group, bias), ref), (path, m, n, k)
    if path == "splitk":
        partials = fp8_linear(acts, w, s, group, group, bias, unreduced=True)
        assert isinstance(partials, SplitKPartials) and same_bits(partials.reduce(), ref), (m, n, k)


def check_attention(device, dtype: torch.dtype, seqs: int, heads: int, kv_heads: int, head_dim: int,
                    group: int | None, scale_ub: float | None, qkv_splits: int, bias: bool, attn_splits: int,
                    qk_norm: bool = False, seed: int = 0) -> None:
    """paged_decode_rope_attention over a split-K QKV GEMM's partials (qkv_splits > 0; 0: the output tensor) and
    with its output quantised (`group`; None: not asked) against the unfused kernels: reduce_splits, the kernel over
    the tensor, quantize_groups of its output. The K/V caches it writes too. Where the launch cannot quantise (a
    head that is not whole groups) the output must come back as the plain tensor."""
    from batchgen.kernels.attention.decode_launch import DecodeLaunch
    from batchgen.kernels.attention.paged_decode import paged_decode_rope_attention
    from batchgen.kernels.attention.rope_kv import QKNorm

    g = torch.Generator().manual_seed(seed)
    block_size, blocks_per_seq = 16, 4
    n = (heads + 2 * kv_heads) * head_dim
    caches = [(torch.randn(seqs * blocks_per_seq + 1, block_size, kv_heads, head_dim, generator=g) * 0.5).to(
        device, dtype) for _ in "kv"]
    tables = torch.arange(seqs * blocks_per_seq, dtype=torch.int32).view(seqs, blocks_per_seq).to(device)
    lens = torch.randint(1, blocks_per_seq * block_size + 1, (seqs,), generator=g, dtype=torch.int32)
    if seqs > 2:
        lens[2] = 0  # a padding row of a graph bucket
    pos = (lens.long() - 1).clamp(min=0)
    slots = torch.where(lens > 0, tables.cpu().long()[torch.arange(seqs), pos // block_size] * block_size
                        + pos % block_size, seqs * blocks_per_seq * block_size).to(device)  # padding: the last block
    angles = pos[:, None].float() * torch.linspace(0.1, 1.0, head_dim)[None, :]
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    part = (torch.randn(max(qkv_splits, 1), seqs, n, generator=g) * 1.5).to(device)
    b = (torch.randn(n, generator=g) * 0.1).to(device, dtype) if bias else None
    qkv = SplitKPartials(part, b, dtype) if qkv_splits else part[0].to(dtype)
    plain_qkv = qkv.reduce() if qkv_splits else qkv
    norm = QKNorm((torch.randn(2, head_dim, generator=g) * 0.2 + 1.0).to(device, dtype), 1e-6) if qk_norm else None
    quant = ActQuant(group, scale_ub) if group else None
    launch = DecodeLaunch(attn_splits, 16, 4)
    what = (dtype, seqs, heads, kv_heads, head_dim, group, scale_ub, qkv_splits, bias, attn_splits, qk_norm)
    outs = []
    for source, q in ((plain_qkv, None), (qkv, quant)):
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        out = paged_decode_rope_attention(source, cos, sin, slots, k_cache, v_cache, tables, lens.to(device), 0.125,
                                          heads, launch=launch, qk_norm=norm, quant=q)
        outs.append((out, k_cache, v_cache))
    (ref, k_ref, v_ref), (got, k_got, v_got) = outs
    assert same_bits(k_got, k_ref) and same_bits(v_got, v_ref), what
    # _launch's rule: heads of a power of two >= 16 dims (D_P == head_dim), each whole groups
    whole_groups = group is not None and head_dim % group == 0 and head_dim & (head_dim - 1) == 0 and head_dim >= 16
    if whole_groups:
        assert_quantized_as(got, ref.reshape(seqs, -1), quant, what)
    else:
        assert isinstance(got, torch.Tensor) and same_bits(got, ref), what

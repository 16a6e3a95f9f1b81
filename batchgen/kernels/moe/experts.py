"""Mixture-of-Experts experts in Triton: grouped GEMMs over the pairs aligned by expert, and the torch reference
they are tested against (CPU, and wherever Triton is absent).

    out[t] = sum_k  w[t, k] * down_e( act(gate_e(h[t])) * up_e(h[t]) ),   e = ids[t, k]

Shapes: T tokens, K = top_k, S = T * K (token, k) pairs ("pair" p = t * K + k), E experts, H hidden, I the
expert's intermediate size. Weights as transformers 5.x stores them: gate_up [E, 2 I, H] (the gate rows, then
the up rows), down [E, H, I]; any strides (transposed layouts are views, never copies).

Steps (every shape a function of T, K, E and block_m only: capturable in CUDA graphs at a fixed batch bucket,
no host synchronisation, no data-dependent shape):
  1. the alignment (kernels/moe/routing.py `align_pairs`): the pairs sorted by expert, each expert's run padded
     to a multiple of block_m; the GEMM grid is sized by the worst case and blocks past `num_padded` exit at once.
  2. `grouped_gemm` gate_up: row p of the output [S, 2 I] is h[p // K] @ gate_up[e]^T (fp32 accumulate, rounded to
     the activation dtype: one GEMM's rounding).
  3. the gated activation over [S, 2 I] (kernels/norm/gated_act.py): [S, I].
  4. `grouped_gemm` down with the routing weight: row p is round(act[p] @ down[e]^T) * w[p], the product in fp32
     and stored in promote(activation dtype, weight dtype): bf16 weights (Qwen's, rounded by its router) give a
     bf16 product, fp32 weights (Mixtral's) an fp32 one, as transformers' `proj_out * sample_weights` rounds.
  5. the combine (kernels/moe/routing.py `combine`): [S, H] viewed [T, K, H] summed over k (torch's sum: fp32
     accumulation, rounded once to the activation dtype), exactly transformers' grouped_mm / batched_mm experts
     forward.
The router (its GEMM, softmax, top-k, renormalise, round) stays torch's ops (models/moe.py).
FP8 experts (an Fp8Weight each, weight [E, N, Kd] float8_e4m3fn with block scales [E, N / group_n, Kd / group_k]):
on CUDA W8A8 as the dense FP8 GEMMs (kernels/fp8/gemm.py): the GEMM's input rows quantised once per token and
group of group_k columns (fp8_quant.quantize_groups: h's T rows for gate_up, the S activation rows for down), and
each k block's fp8 x fp8 product scaled by the row's and the weight block's scales in the grouped GEMM (BLOCK_K =
group_k); on CPU (and without Triton) the reference dequantises the hit experts' weights and runs as for plain
weights: what transformers computes over the checkpoint it dequantised on load.
Invariants: every pair appears exactly once in the sorted rows (so every output row of 2.-4. is written; no
memset); padding rows (sentinel S) are neither loaded (masked) nor stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.kernels.fp8.quant import Fp8Weight, dequantize_weight, linear_ref, quantize_groups
from batchgen.kernels.norm.gated_act import gated_act, gated_act_ref
from batchgen.kernels.moe.routing import Alignment, align_pairs, combine

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per GEMM block, from the shape alone (a graph bucket's choice is fixed): 16 (tl.dot's minimum) while
    experts get few rows each (decode: every block reads its expert's weights once), larger for prefill."""
    per_expert = num_pairs / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


if triton is not None:
    @triton.jit
    def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, rw_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                         N, K, stride_am, stride_we, stride_wn, stride_wk, stride_cm,
                         as_ptr, ws_ptr, stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, group_n,
                         A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                         FP8: tl.constexpr, ROUND_TO: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One [BLOCK_M, BLOCK_N] tile of C[p] = A[p // A_ROW_DIV] @ W[e]^T for the pairs p of one row block,
        rounded to ROUND_TO. FP8: A and W float8_e4m3fn, each k block's product times the A row's scale
        as[a_row, kb] and the W block's ws[e, n // group_n, kb] (BLOCK_K is the scale block's width)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # past the used rows: the worst-case grid's spare blocks
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]; S in padding rows
        valid = pairs < num_pairs
        a_rows = (pairs // A_ROW_DIV).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        as_ptrs = as_ptr + a_rows * stride_asm  # FP8 only: [BLOCK_M] row scales (k block 0)
        ws_ptrs = ws_ptr + expert * stride_wse + (cols // group_n).to(tl.int64) * stride_wsn  # [BLOCK_N]
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            if FP8:
                a_s = tl.load(as_ptrs + (k0 // BLOCK_K) * stride_ask, mask=valid, other=0.0)  # [BLOCK_M]
                w_s = tl.load(ws_ptrs + (k0 // BLOCK_K) * stride_wsk, mask=col_ok, other=0.0)  # [BLOCK_N]
                acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
            else:
                acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        out = acc.to(ROUND_TO)  # the GEMM's own rounding (the activation dtype), before the routing weight
        if MUL_WEIGHT:
            rw = tl.load(rw_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
            out = out.to(tl.float32) * rw[:, None]
        c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + cols[None, :]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def _launch(block_m: int) -> dict:
    """Tile and launch settings per row-block size (a first choice; tuned on the GPU, not here)."""
    if block_m <= 16:
        return dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_N=128, BLOCK_K=64, num_warps=4 if block_m <= 32 else 8, num_stages=3)


_TL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def grouped_gemm(a: torch.Tensor, weight: torch.Tensor | Fp8Weight, align: Alignment, a_row_div: int,
                 routing_weights: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """C [S, N], C[p] = a[p // a_row_div] @ weight[e(p)]^T (times routing_weights[p] if given), rounded to a's
    dtype before the routing weight. a: [R, Kd] contiguous rows; weight: [E, N, Kd] any strides, or an Fp8Weight
    (a quantised per token and group of its group_k columns first, once: R rows); routing_weights: [S]."""
    num_pairs = align.num_pairs
    fp8 = isinstance(weight, Fp8Weight)
    w = weight.weight if fp8 else weight
    assert a.stride(1) == 1 and a.shape[1] == w.shape[2]
    n = w.shape[1]
    out = torch.empty(num_pairs, n, dtype=out_dtype or a.dtype, device=a.device)
    launch = _launch(align.block_m)
    if fp8:
        aq, a_scale = quantize_groups(a, weight.group_k, weight.scale_ub)  # [R, Kd] fp8, [R, Kd / group_k]
        ws = weight.scale  # [E, N / group_n, Kd / group_k]
        scale_args = (a_scale, ws, a_scale.stride(0), a_scale.stride(1), ws.stride(0), ws.stride(1), ws.stride(2),
                      weight.group_n)
        launch["BLOCK_K"] = weight.group_k  # one scale block a k step
    else:
        aq, scale_args = a, (a, a, 0, 0, 0, 0, 0, 1)  # no scales: never read
    grid = (align.block_expert.shape[0], triton.cdiv(n, launch["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        aq, w, out, routing_weights if routing_weights is not None else out, align.sorted_pairs,
        align.block_expert, align.num_padded, num_pairs, n, a.shape[1], aq.stride(0), w.stride(0),
        w.stride(1), w.stride(2), out.stride(0), *scale_args, A_ROW_DIV=a_row_div,
        MUL_WEIGHT=routing_weights is not None, INPUT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        FP8=fp8, ROUND_TO=getattr(tl, _TL_DTYPES[a.dtype]), BLOCK_M=align.block_m, **launch)
    return out


def fused_experts(h: torch.Tensor, gate_up: torch.Tensor | Fp8Weight, down: torch.Tensor | Fp8Weight,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: str = "silu", use_triton: bool = True,
                  routed_counts: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' output [T, H] for h [T, H], topk_ids [T, K], topk_weights [T, K] (the router's
    dtype decides the product's rounding, see the module docstring). routed_counts [E] int64, when given, gets
    each expert's pairs added (by the alignment kernel where it runs: no launch of its own). FP8 experts
    (Fp8Weight) run W8A8 on Triton, dequantised on the reference path (module docstring)."""
    if not use_triton:
        if routed_counts is not None:
            flat = topk_ids.reshape(-1)
            routed_counts.scatter_add_(0, flat, torch.ones_like(flat))
        return fused_experts_ref(h, gate_up, down, topk_ids, topk_weights, activation)
    top_k, num_experts, num_pairs = topk_ids.shape[1], gate_up.shape[0], topk_ids.numel()
    align = align_pairs(topk_ids, num_experts, choose_block_m(num_pairs, num_experts), routed_counts)
    gate_up_out = grouped_gemm(h, gate_up, align, a_row_div=top_k)  # [S, 2 I]
    act = gated_act(gate_up_out, activation, use_triton=True)  # [S, I]
    weighted = grouped_gemm(act, down, align, a_row_div=1, routing_weights=topk_weights.reshape(-1),
                            out_dtype=torch.promote_types(h.dtype, topk_weights.dtype))  # [S, H]
    return combine(weighted, top_k, h.dtype)


def fused_experts_ref(h: torch.Tensor, gate_up: torch.Tensor | Fp8Weight, down: torch.Tensor | Fp8Weight,
                      topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: str = "silu",
                      w8a8: bool = False) -> torch.Tensor:
    """The torch reference, one GEMM pair per expert hit, with transformers' roundings (module docstring).
    Reads the hit experts on the host (.tolist()): a reference, not capturable in CUDA graphs. FP8 experts: the
    expert's weight dequantised (the CPU path), or with `w8a8` the kernels' W8A8 emulated (fp8_quant.linear_ref)."""
    num_tokens, top_k = topk_ids.shape
    flat, rw = topk_ids.reshape(-1), topk_weights.reshape(-1)  # [S], [S]
    weighted = torch.empty(flat.numel(), h.shape[1], dtype=torch.promote_types(h.dtype, rw.dtype),
                           device=h.device)  # [S, H]; every row written below (each pair has one expert)

    def expert_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, e: int) -> torch.Tensor:
        if not isinstance(weight, Fp8Weight):
            return F.linear(x, weight[e])
        if w8a8:
            return linear_ref(x, weight.weight[e], weight.scale[e], weight.group_n, weight.group_k,
                              act_group=weight.group_k, scale_ub=weight.scale_ub)
        return F.linear(x, dequantize_weight(weight.weight[e], weight.scale[e], weight.group_n, weight.group_k,
                                             x.dtype))

    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero()[:, 0]  # [n_e]
        act = gated_act_ref(expert_linear(h[pairs // top_k], gate_up, e), activation)  # [n_e, I]
        weighted[pairs] = expert_linear(act, down, e) * rw[pairs, None]
    return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(h.dtype)

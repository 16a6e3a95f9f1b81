"""Mixture-of-Experts experts in Triton: token grouping by expert, grouped GEMMs, the weighted combine; and the
torch reference they are tested against (CPU, and wherever Triton is absent).

    out[t] = sum_k  w[t, k] * down_e( act(gate_e(h[t])) * up_e(h[t]) ),   e = ids[t, k]

Shapes: T tokens, K = top_k, S = T * K (token, k) pairs ("pair" p = t * K + k), E experts, H hidden, I the
expert's intermediate size. Weights as transformers 5.x stores them: gate_up [E, 2 I, H] (the gate rows, then
the up rows), down [E, H, I]; any strides (transposed layouts are views, never copies).

Steps (every shape a function of T, K, E and block_m only: capturable in CUDA graphs at a fixed batch bucket,
no host synchronisation, no data-dependent shape):
  1. `align_by_expert`: the pairs sorted by expert id, each expert's run padded to a multiple of block_m with
     the sentinel S; `block_expert[b]` is the expert of rows b*block_m..; `num_padded` (a device scalar) ends the
     used rows. Worst case rows: S + min(E, S) * (block_m - 1) (each expert that gets a pair pads < block_m rows),
     so the buffers and the GEMM grid are sized by that bound and blocks past `num_padded` exit at once.
  2. `grouped_gemm` gate_up: row p of the output [S, 2 I] is h[p // K] @ gate_up[e]^T (fp32 accumulate, rounded to
     the activation dtype: one GEMM's rounding).
  3. the gated activation over [S, 2 I] (kernels/gated_act.py): [S, I].
  4. `grouped_gemm` down with the routing weight: row p is round(act[p] @ down[e]^T) * w[p], the product in fp32
     and stored in promote(activation dtype, weight dtype): bf16 weights (Qwen's, rounded by its router) give a
     bf16 product, fp32 weights (Mixtral's) an fp32 one, as transformers' `proj_out * sample_weights` rounds.
  5. combine: [S, H] viewed [T, K, H] summed over k (torch's sum: fp32 accumulation, rounded once to the
     activation dtype), exactly transformers' grouped_mm / batched_mm experts forward; on the GPU one kernel
     (`combine_topk`) in torch's reduce order.
The router (softmax, top-k, renormalise, round: `route_topk`) and the alignment (`align_by_expert_triton`, up to
ALIGN_MAX_PAIRS pairs) are one launch each; the torch ops stay the reference, the CPU path and the fallback
wherever a kernel does not reproduce them bit for bit (`exact_on`).
Invariants: every pair appears exactly once in the sorted rows (so every output row of 2.-4. is written; no
memset); padding rows (sentinel S) are neither loaded (masked) nor stored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.kernels.gated_act import gated_act, gated_act_ref

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

# The interpreter (TRITON_INTERPRET=1, CPU tests) has neither libdevice's expf nor div.rn: it computes exp and the
# division in numpy (IEEE) instead; compiled kernels use the accurate forms, as torch's CUDA kernels compute them.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class Alignment:
    """The (token, k) pairs grouped by expert, each expert's rows padded to a multiple of block_m."""

    sorted_pairs: torch.Tensor  # [NB * block_m] int32: pair ids by expert; S (the sentinel) in padding rows
    block_expert: torch.Tensor  # [NB] int32: the expert of each row block (>= E past num_padded: unused)
    num_padded: torch.Tensor  # [1] int32: rows in use (a multiple of block_m); device-side, never read on host
    tokens_per_expert: torch.Tensor  # [E] int64: pairs routed to each expert
    num_pairs: int  # S = T * K (host-known: a shape)
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Row blocks the padded pairs can need at most: S + min(E, S) * (block_m - 1) rows, rounded up."""
    return -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per GEMM block, from the shape alone (a graph bucket's choice is fixed): 16 (tl.dot's minimum) while
    experts get few rows each (decode: every block reads its expert's weights once), larger for prefill."""
    per_expert = num_pairs / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """topk_ids [T, K] (int) -> Alignment. Torch ops of fixed shapes only (sort, scatter, cumsum, searchsorted):
    no host synchronisation. Within an expert the pairs keep ascending pair order (a stable sort)."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [S]
    num_pairs = flat.numel()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)  # [E]: one past each expert's last padded row
    padded_start = padded_end - padded  # [E]
    raw_start = counts.cumsum(0) - counts  # [E]: each expert's first position among the sorted pairs
    order = torch.argsort(flat, stable=True)  # [S]: pair ids by expert
    expert_of = flat.index_select(0, order)  # [S]
    dest = padded_start.index_select(0, expert_of) + torch.arange(num_pairs, device=dev) \
        - raw_start.index_select(0, expert_of)  # [S]: each sorted pair's padded row
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=dev) * block_m  # [NB]
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)  # [NB]
    return Alignment(sorted_pairs, block_expert, padded_end[-1:].to(torch.int32), counts, num_pairs,
                     block_m)


if triton is not None:
    @triton.jit
    def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, rw_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                         N, K, stride_am, stride_we, stride_wn, stride_wk, stride_cm,
                         A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One [BLOCK_M, BLOCK_N] tile of C[p] = A[p // A_ROW_DIV] @ W[e]^T for the pairs p of one row block."""
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
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        out = acc.to(a_ptr.dtype.element_ty)  # the GEMM's own rounding, before the routing weight
        if MUL_WEIGHT:
            rw = tl.load(rw_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
            out = out.to(tl.float32) * rw[:, None]
        c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + cols[None, :]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


# ---- the steps' small kernels: routing, alignment, combine (one launch each; torch ops are the reference) ----
#
# Each reproduces the torch ops it replaces bit for bit on CUDA: the same fp32 operations in the same order as
# torch's CUDA kernels (the warp softmax's per-lane sums and xor butterfly, expf, IEEE division; the reduce
# kernel's orders for the top-k sum and the sum over k). Those orders are torch's implementation, not its
# contract: `exact_on(device, ...)` checks each kernel against the torch ops once per process and configuration
# on the device, and the callers keep the torch ops where a kernel differs (a warning says which).

ALIGN_MAX_PAIRS = 4096  # one program aligns up to this many pairs (decode buckets); larger steps use the torch ops
ALIGN_MAX_EXPERTS = 256


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


if triton is not None:
    @triton.jit
    def _halve(s):
        """[2n] -> [n]: s[i] + s[i + n] (one step of a warp's xor butterfly: lane i with lane i ^ n)."""
        n: tl.constexpr = s.shape[0] // 2
        return tl.sum(tl.reshape(s, (2, n)), axis=0)

    @triton.jit
    def _pairs(s):
        """[2n] -> [n]: s[2i] + s[2i + 1] (one step of a shfl_down tree)."""
        n: tl.constexpr = s.shape[0] // 2
        return tl.sum(tl.reshape(s, (n, 2)), axis=1)

    @triton.jit
    def _pair_tree(s):
        """Sum of s [n <= 32, a power of 2] as torch's reduce kernel combines a warp's lanes (shfl_down 1, 2, ..)."""
        if s.shape[0] >= 2:
            s = _pairs(s)
        if s.shape[0] >= 2:
            s = _pairs(s)
        if s.shape[0] >= 2:
            s = _pairs(s)
        if s.shape[0] >= 2:
            s = _pairs(s)
        if s.shape[0] >= 2:
            s = _pairs(s)
        return tl.sum(s, axis=0)

    @triton.jit
    def _router_kernel(x_ptr, ids_ptr, w_ptr, num_experts, stride_x, TOP_K: tl.constexpr, KP: tl.constexpr,
                       SOFTMAX: tl.constexpr, RENORM: tl.constexpr, ACCURATE: tl.constexpr, WARP: tl.constexpr,
                       ITERS: tl.constexpr):
        """One token row: softmax over the experts (fp32), top-k (largest first; ties: the lower expert), the
        optional renormalisation, the weights stored in w_ptr's dtype. The softmax is torch's warp softmax
        (persistent_softmax.cuh) step for step: lane l holds experts l, l + WARP, ..; max; expf(x - max); each
        lane's sum in order, then the xor butterfly over the lanes; expf(x - max) / sum. The top-k sum is torch's
        reduce over a row of K: lane x sums x and x + P (P the largest power of 2 <= K), then a shfl_down tree."""
        row = tl.program_id(0).to(tl.int64)
        its = tl.arange(0, ITERS)
        lanes = tl.arange(0, WARP)
        idx = its[:, None] * WARP + lanes[None, :]  # [ITERS, WARP]: expert it * WARP + lane
        ok = idx < num_experts
        x = tl.load(x_ptr + row * stride_x + idx, mask=ok, other=float("-inf")).to(tl.float32)
        if SOFTMAX:
            mx = tl.max(tl.max(x, axis=1), axis=0)
            if ACCURATE:
                e = libdevice.exp(x - mx)  # CUDA's expf; padding: exp(-inf) = 0
            else:
                e = tl.exp(x - mx)
            s = tl.zeros((WARP,), tl.float32)
            for i in tl.static_range(ITERS):  # each lane's elements in order (a row picked exactly: x + 0)
                s += tl.sum(tl.where(its[:, None] == i, e, 0.0), axis=0)
            if WARP >= 2:
                s = _halve(s)
            if WARP >= 4:
                s = _halve(s)
            if WARP >= 8:
                s = _halve(s)
            if WARP >= 16:
                s = _halve(s)
            if WARP >= 32:
                s = _halve(s)
            total = tl.sum(s, axis=0)
            if ACCURATE:
                p = tl.div_rn(e, tl.zeros_like(e) + total)
            else:
                p = e / total
        else:  # x holds the probabilities already
            p = x
        p = tl.reshape(tl.where(ok, p, -1.0), (ITERS * WARP,))  # probabilities >= 0: padding never chosen
        flat = tl.arange(0, ITERS * WARP)
        ks = tl.arange(0, KP)
        top_w = tl.zeros((KP,), tl.float32)
        top_i = tl.zeros((KP,), tl.int32)
        for k in tl.static_range(TOP_K):
            v, i = tl.max(p, axis=0, return_indices=True, return_indices_tie_break_left=True)
            top_w = tl.where(ks == k, v, top_w)
            top_i = tl.where(ks == k, i, top_i)
            p = tl.where(flat == i, -1.0, p)
        if RENORM:
            s = top_w  # zeros past K: adding them is exact
            if KP != TOP_K:
                s = _halve(s)
            total = _pair_tree(s)
            if ACCURATE:
                top_w = tl.div_rn(top_w, tl.zeros_like(top_w) + total)
            else:
                top_w = top_w / total
        kmask = ks < TOP_K
        tl.store(ids_ptr + row * TOP_K + ks, top_i.to(tl.int64), mask=kmask)
        tl.store(w_ptr + row * TOP_K + ks, top_w.to(w_ptr.dtype.element_ty), mask=kmask)

    @triton.jit
    def _align_kernel(ids_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, counts_ptr, routed_ptr, num_pairs,
                      num_experts, num_rows, num_blocks, COUNT_ROUTES: tl.constexpr, BLOCK_M: tl.constexpr,
                      EP: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr, BCHUNK: tl.constexpr):
        """align_by_expert in one program: per-expert counts, padded prefix sums, each pair scattered to its
        expert's next row (pairs in ascending order within an expert), padding rows S, each block's expert."""
        es = tl.arange(0, EP)
        cs = tl.arange(0, CHUNK)
        real = es < num_experts
        counts = tl.zeros((EP,), tl.int32)
        for c0 in range(0, num_pairs, CHUNK):
            p = c0 + cs
            e = tl.load(ids_ptr + p, mask=p < num_pairs, other=EP).to(tl.int32)  # EP: no expert's column
            counts += tl.sum((e[:, None] == es[None, :]).to(tl.int32), axis=0)
        padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
        end = tl.cumsum(padded, axis=0)  # one past each expert's last padded row
        tl.store(counts_ptr + es, counts.to(tl.int64), mask=real)
        if COUNT_ROUTES:
            old = tl.load(routed_ptr + es, mask=real, other=0)
            tl.store(routed_ptr + es, old + counts.to(tl.int64), mask=real)
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        for b0 in range(0, num_blocks, BCHUNK):  # searchsorted(end, b * BLOCK_M, right=True)
            b = b0 + tl.arange(0, BCHUNK)
            hit = (end[None, :] <= (b * BLOCK_M)[:, None]) & real[None, :]
            tl.store(block_expert_ptr + b, tl.sum(hit.to(tl.int32), axis=1), mask=b < num_blocks)
        for r0 in range(0, num_rows, FILL):  # the sentinel everywhere, then the pairs over it
            r = r0 + tl.arange(0, FILL)
            tl.store(pairs_ptr + r, tl.zeros((FILL,), tl.int32) + num_pairs, mask=r < num_rows)
        tl.debug_barrier()
        cursor = end - padded  # each expert's next free row
        for c0 in range(0, num_pairs, CHUNK):
            p = c0 + cs
            e = tl.load(ids_ptr + p, mask=p < num_pairs, other=EP).to(tl.int32)
            onehot = (e[:, None] == es[None, :]).to(tl.int32)  # [CHUNK, EP]
            rows = tl.cumsum(onehot, axis=0) - onehot + cursor[None, :]  # earlier pairs of the chunk, same expert
            tl.store(pairs_ptr + tl.sum(onehot * rows, axis=1), p, mask=p < num_pairs)
            cursor += tl.sum(onehot, axis=0)

    @triton.jit
    def _combine_kernel(x_ptr, out_ptr, hidden, TOP_K: tl.constexpr, NACC: tl.constexpr, BLOCK: tl.constexpr):
        """out[t] = sum_k x[t, k] in fp32, rounded once, in torch's reduce order over a strided dim: accumulator i
        (< NACC, torch's vt0) takes k = i, i + NACC, .. in turn; then the accumulators in order."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < hidden
        base = x_ptr + t * TOP_K * hidden + cols
        total = tl.zeros((BLOCK,), tl.float32)
        for i in tl.static_range(NACC):
            acc = tl.zeros((BLOCK,), tl.float32)
            for k in tl.static_range(i, TOP_K, NACC):
                acc += tl.load(base + k * hidden, mask=m, other=0.0).to(tl.float32)
            total += acc  # total starts at 0: 0 + acc_0 is acc_0
        tl.store(out_ptr + t * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=m)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype,
               softmax: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch for (softmax fp32 ->) top-k -> (renormalise) -> round: logits [T, E] (or fp32 probabilities
    with softmax=False) -> (ids [T, K] int64, weights [T, K] out_dtype), as route_topk_ref."""
    num_tokens, num_experts = logits.shape
    assert logits.stride(1) == 1 and top_k <= 32
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=out_dtype, device=logits.device)
    width = _pow2(num_experts)
    warp = min(width, 32)
    _router_kernel[(num_tokens,)](logits, ids, weights, num_experts, logits.stride(0), TOP_K=top_k,
                                  KP=_pow2(top_k), SOFTMAX=softmax, RENORM=renormalize,
                                  ACCURATE=not _INTERPRETED, WARP=warp, ITERS=width // warp, num_warps=1)
    return ids, weights


def route_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool,
                   out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' routers: softmax in fp32, top-k of the probabilities, renormalised in fp32, rounded."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    top_w, top_ids = torch.topk(probs, top_k, dim=-1)  # [T, K] each
    if renormalize:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_ids, top_w.to(out_dtype)


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                           routed_counts: torch.Tensor | None = None) -> Alignment:
    """align_by_expert in one launch (S <= ALIGN_MAX_PAIRS, E <= ALIGN_MAX_EXPERTS), the same Alignment; adds
    the counts to routed_counts [E] int64 when given."""
    dev = topk_ids.device
    num_pairs = topk_ids.numel()
    assert num_pairs <= ALIGN_MAX_PAIRS and num_experts <= ALIGN_MAX_EXPERTS and topk_ids.is_contiguous()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int64, device=dev)
    ep = max(_pow2(num_experts), 16)
    _align_kernel[(1,)](topk_ids, sorted_pairs, block_expert, num_padded, counts,
                        routed_counts if routed_counts is not None else counts, num_pairs, num_experts,
                        num_blocks * block_m, num_blocks, COUNT_ROUTES=routed_counts is not None, BLOCK_M=block_m,
                        EP=ep, CHUNK=max(16, min(128, 16384 // ep)), FILL=1024, BCHUNK=max(16, min(64, 8192 // ep)),
                        num_warps=8)
    return Alignment(sorted_pairs, block_expert, num_padded, counts, num_pairs, block_m)


def combine_topk(weighted: torch.Tensor, top_k: int, out_dtype: torch.dtype, nacc: int = 4) -> torch.Tensor:
    """weighted [S, H] -> [T, H]: the sum over each token's K rows in fp32, rounded once to out_dtype (one
    launch for torch's view(T, K, H).sum(1).to(out_dtype))."""
    num_pairs, hidden = weighted.shape
    assert weighted.is_contiguous()
    out = torch.empty(num_pairs // top_k, hidden, dtype=out_dtype, device=weighted.device)
    block = min(1024, _pow2(hidden))
    _combine_kernel[(num_pairs // top_k, triton.cdiv(hidden, block))](weighted, out, hidden, TOP_K=top_k, NACC=nacc,
                                                                      BLOCK=block, num_warps=4)
    return out


def combine_topk_ref(weighted: torch.Tensor, top_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    return weighted.view(weighted.shape[0] // top_k, top_k, -1).sum(dim=1).to(out_dtype)


_EXACT: dict = {}


def exact_on(kind: str, device: torch.device, *config) -> bool | int:
    """Whether the kernel `kind` equals the torch ops it replaces, bit for bit, on `device` for `config`: checked
    once per process on random data (a host sync: call outside graph capture; the decoders call it when built).
    "router" (num_experts, top_k, renormalize, logits dtype, weights dtype): True / False. "combine" (top_k,
    weighted dtype, out dtype): the accumulator count that matches torch's order (4, else 1), or 0 for none.
    Off CUDA (the interpreter's tests): True / 4, nothing checked."""
    key = (kind, str(device), *config)
    if key in _EXACT:
        return _EXACT[key]
    if triton is None or device.type != "cuda":
        return True if kind == "router" else 4
    if torch.cuda.is_current_stream_capturing():  # unchecked configuration inside a capture: the torch ops
        return False if kind == "router" else 0
    g = torch.Generator(device=device).manual_seed(1234)
    if kind == "router":
        num_experts, top_k, renormalize, in_dtype, out_dtype = config
        logits = (torch.randn(4096, num_experts, device=device, generator=g) * 2).to(in_dtype)
        ids, w = route_topk(logits, top_k, renormalize, out_dtype)
        ref_ids, ref_w = route_topk_ref(logits, top_k, renormalize, out_dtype)
        sorted_ids = torch.sort(torch.softmax(logits, -1, dtype=torch.float32), -1, descending=True).values
        no_tie = (sorted_ids[:, :top_k] != sorted_ids[:, 1:top_k + 1]).all(dim=1)  # tie order: unspecified
        result = bool((torch.equal(ids[no_tie], ref_ids[no_tie]) and torch.equal(w[no_tie], ref_w[no_tie])))
    else:
        top_k, in_dtype, out_dtype = config
        weighted = torch.randn(64 * top_k, 512, device=device, generator=g).to(in_dtype)
        ref = combine_topk_ref(weighted, top_k, out_dtype)
        result = next((n for n in (4, 1) if torch.equal(combine_topk(weighted, top_k, out_dtype, n), ref)), 0)
    if not result:
        import warnings
        warnings.warn(f"batchgen MoE: the {kind} kernel differs from torch's ops for {config} on {device}: "
                      "keeping the torch ops")
    _EXACT[key] = result
    return result


def _launch(block_m: int) -> dict:
    """Tile and launch settings per row-block size (a first choice; tuned on the GPU, not here)."""
    if block_m <= 16:
        return dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_N=128, BLOCK_K=64, num_warps=4 if block_m <= 32 else 8, num_stages=3)


def grouped_gemm(a: torch.Tensor, weight: torch.Tensor, align: Alignment, a_row_div: int,
                 routing_weights: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """C [S, N], C[p] = a[p // a_row_div] @ weight[e(p)]^T (times routing_weights[p] if given).
    a: [R, Kd] contiguous rows; weight: [E, N, Kd] any strides; routing_weights: [S]."""
    num_pairs = align.num_pairs
    assert a.stride(1) == 1 and a.shape[1] == weight.shape[2]
    n = weight.shape[1]
    out = torch.empty(num_pairs, n, dtype=out_dtype or a.dtype, device=a.device)
    launch = _launch(align.block_m)
    grid = (align.block_expert.shape[0], triton.cdiv(n, launch["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        a, weight, out, routing_weights if routing_weights is not None else out, align.sorted_pairs,
        align.block_expert, align.num_padded, num_pairs, n, a.shape[1], a.stride(0), weight.stride(0),
        weight.stride(1), weight.stride(2), out.stride(0), A_ROW_DIV=a_row_div,
        MUL_WEIGHT=routing_weights is not None, INPUT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        BLOCK_M=align.block_m, **launch)
    return out


def fused_experts(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, activation: str = "silu", use_triton: bool = True,
                  routed_counts: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' output [T, H] for h [T, H], topk_ids [T, K], topk_weights [T, K] (the router's
    dtype decides the product's rounding, see the module docstring). routed_counts [E] int64, when given, gets
    each expert's pairs added (by the alignment kernel where it runs: no launch of its own)."""
    if not use_triton:
        if routed_counts is not None:
            flat = topk_ids.reshape(-1)
            routed_counts.scatter_add_(0, flat, torch.ones_like(flat))
        return fused_experts_ref(h, gate_up, down, topk_ids, topk_weights, activation)
    num_tokens, top_k = topk_ids.shape
    num_experts, num_pairs = gate_up.shape[0], topk_ids.numel()
    block_m = choose_block_m(num_pairs, num_experts)
    if num_pairs <= ALIGN_MAX_PAIRS and num_experts <= ALIGN_MAX_EXPERTS:  # a shape: fixed per graph bucket
        align = align_by_expert_triton(topk_ids.contiguous(), num_experts, block_m, routed_counts)
    else:
        align = align_by_expert(topk_ids, num_experts, block_m)
        if routed_counts is not None:
            routed_counts += align.tokens_per_expert
    gate_up_out = grouped_gemm(h, gate_up, align, a_row_div=top_k)  # [S, 2 I]
    act = gated_act(gate_up_out, activation, use_triton=True)  # [S, I]
    weighted = grouped_gemm(act, down, align, a_row_div=1, routing_weights=topk_weights.reshape(-1),
                            out_dtype=torch.promote_types(h.dtype, topk_weights.dtype))  # [S, H]
    nacc = exact_on("combine", h.device, top_k, weighted.dtype, h.dtype)
    if not nacc:
        return combine_topk_ref(weighted, top_k, h.dtype)
    return combine_topk(weighted, top_k, h.dtype, nacc)


def fused_experts_ref(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The torch reference, one GEMM pair per expert hit, with transformers' roundings (module docstring).
    Reads the hit experts on the host (.tolist()): a reference, not capturable in CUDA graphs."""
    num_tokens, top_k = topk_ids.shape
    flat, rw = topk_ids.reshape(-1), topk_weights.reshape(-1)  # [S], [S]
    weighted = torch.empty(flat.numel(), h.shape[1], dtype=torch.promote_types(h.dtype, rw.dtype),
                           device=h.device)  # [S, H]; every row written below (each pair has one expert)
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero()[:, 0]  # [n_e]
        act = gated_act_ref(F.linear(h[pairs // top_k], gate_up[e]), activation)  # [n_e, I]
        weighted[pairs] = F.linear(act, down[e]) * rw[pairs, None]
    return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(h.dtype)

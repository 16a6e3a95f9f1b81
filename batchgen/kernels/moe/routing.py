"""The MoE experts' regrouping around their grouped GEMMs (kernels/moe/experts.py): the (token, k) pairs aligned by expert
into padded row blocks, and the combine of each token's K expert rows back into one row. Each is one Triton launch,
with the torch ops as reference, CPU path and fallback.

Shapes: T tokens, K = top_k, S = T * K pairs (pair p = t * K + k), E experts, H hidden.

  alignment (`align_pairs`): the pairs sorted by expert id (ascending pair order within an expert), each expert's
     run padded to a multiple of block_m with the sentinel S; `block_expert[b]` is the expert of rows
     b*block_m..; `num_padded` (a device scalar) ends the used rows. Worst case rows: S + min(E, S) * (block_m - 1)
     (each expert that gets a pair pads < block_m rows): buffers and grids are sized by that bound. Integer work:
     the kernel (up to ALIGN_MAX_PAIRS pairs, one program) gives the torch ops' tensors exactly.
  combine (`combine`): [S, H] viewed [T, K, H] summed over k in fp32, rounded once (torch's sum, as transformers'
     experts forward). The kernel adds in torch's reduce order over a strided dim (NACC accumulators, k = i,
     i + NACC, ..; then the accumulators in order); that order is torch's implementation, not its contract, so
     `combine_accumulators` checks it against torch once per process and configuration on the device, and the
     torch sum stays where no order matches (a warning says so).
Every shape is a function of T, K, E and block_m only: capturable in CUDA graphs, no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the torch ops
    triton = None

ALIGN_MAX_PAIRS = 4096  # one program aligns up to this many pairs (decode buckets); larger steps use the torch ops
ALIGN_MAX_EXPERTS = 256


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


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


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


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                routed_counts: torch.Tensor | None = None) -> Alignment:
    """The Alignment of topk_ids [T, K] for the grouped GEMMs: the kernel where the shape fits it (a shape: fixed
    per graph bucket), else the torch ops; each expert's pairs added to routed_counts [E] int64 when given."""
    if topk_ids.numel() <= ALIGN_MAX_PAIRS and num_experts <= ALIGN_MAX_EXPERTS:
        return align_by_expert_triton(topk_ids.contiguous(), num_experts, block_m, routed_counts)
    align = align_by_expert(topk_ids, num_experts, block_m)
    if routed_counts is not None:
        routed_counts += align.tokens_per_expert
    return align


def combine_topk(weighted: torch.Tensor, top_k: int, out_dtype: torch.dtype, nacc: int = 4) -> torch.Tensor:
    """weighted [S, H] -> [T, H]: the sum over each token's K rows in fp32 with nacc accumulators, rounded once
    to out_dtype (one launch for torch's view(T, K, H).sum(1).to(out_dtype))."""
    num_pairs, hidden = weighted.shape
    assert weighted.is_contiguous()
    out = torch.empty(num_pairs // top_k, hidden, dtype=out_dtype, device=weighted.device)
    block = min(1024, _pow2(hidden))
    _combine_kernel[(num_pairs // top_k, triton.cdiv(hidden, block))](weighted, out, hidden, TOP_K=top_k, NACC=nacc,
                                                                      BLOCK=block, num_warps=4)
    return out


def combine_topk_ref(weighted: torch.Tensor, top_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    return weighted.view(weighted.shape[0] // top_k, top_k, -1).sum(dim=1).to(out_dtype)


_ACCUMULATORS: dict = {}  # (device, top_k, weighted dtype, out dtype) -> combine_accumulators' answer


def combine_accumulators(device: torch.device, top_k: int, in_dtype: torch.dtype, out_dtype: torch.dtype) -> int:
    """The accumulator count (4, else 1) with which combine_topk equals torch's sum over k bit for bit on
    `device`, or 0 for none: checked once per process and configuration on random data (a host sync: call outside
    graph capture; the decoders call it when built). Off CUDA (the interpreter's tests): 4, nothing checked."""
    key = (str(device), top_k, in_dtype, out_dtype)
    if key in _ACCUMULATORS:
        return _ACCUMULATORS[key]
    if triton is None or device.type != "cuda":
        return 4
    if torch.cuda.is_current_stream_capturing():  # unchecked configuration inside a capture: the torch sum
        return 0
    g = torch.Generator(device=device).manual_seed(1234)
    weighted = torch.randn(64 * top_k, 512, device=device, generator=g).to(in_dtype)
    ref = combine_topk_ref(weighted, top_k, out_dtype)
    result = next((n for n in (4, 1) if torch.equal(combine_topk(weighted, top_k, out_dtype, n), ref)), 0)
    if not result:
        import warnings
        warnings.warn(f"batchgen MoE: the combine kernel differs from torch's sum over k for top-{top_k} "
                      f"{in_dtype} -> {out_dtype} on {device}: keeping the torch ops")
    _ACCUMULATORS[key] = result
    return result


def combine(weighted: torch.Tensor, top_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """weighted [S, H] -> [T, H] as combine_topk_ref: the kernel where it reproduces torch's order, else torch."""
    nacc = combine_accumulators(weighted.device, top_k, weighted.dtype, out_dtype)
    if not nacc:
        return combine_topk_ref(weighted, top_k, out_dtype)
    return combine_topk(weighted, top_k, out_dtype, nacc)

"""FP8 (float8_e4m3fn) quantisation: weights and activations, the torch references of the FP8 GEMMs, and the
Triton activation quantisers: per token (feeds torch._scaled_mm row-wise) and per token and group of columns
(feeds the block-scaled GEMMs, once per GEMM: `quantize_groups`, or, fused, the kernel that writes the GEMM's input
quantises it with the same jit helpers and hands the GEMM `QuantizedActs`).

Conventions (those of the checkpoints: transformers' FineGrainedFP8 `weight_scale_inv`, compressed-tensors' and
fbgemm's `weight_scale`): a scale multiplies, value = fp8 * scale. A weight [N, K] has either
  - per-channel scales [N, 1] (group_k None; a per-tensor scale is expanded to this on load), or
  - block scales [ceil(N / group_n), ceil(K / group_k)]: one per (group_n rows x group_k columns) block; the last
    block of a dimension may be partial. group_n 1 is a per-row block scale (what fusing q/k/v whose row counts
    are not multiples of the block leaves, see quant/modules.py).
Activations x [M, K] are quantised dynamically: per token (one scale per row) for _scaled_mm, or per token and
group of group_k columns for the block GEMM; scale = max(amax, AMAX_EPS) / 448 (fbgemm: amax capped at its
activation_scale_ub first), q = clamp(x / scale, +-448) rounded to nearest even.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the references
    triton = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
CHANNEL_ACT_GROUP = 128  # activation group of the Triton GEMMs over per-channel weights (group_k None)
AMAX_EPS = 1e-10  # floor of a row's (group's) absolute max: an all-zero row gets a tiny scale, not a 0 / 0


@dataclass(frozen=True)
class Fp8Weight:
    """One (possibly fused) FP8 projection as the fused decoders hold it (quant/linear.py), or a layer's FP8 experts
    (a leading expert dimension E on both tensors, kernels/moe/experts.py). Invariant: scale's shape follows (group_n,
    group_k) and weight's as quant/modules.py Fp8Linear's does."""

    weight: torch.Tensor  # [N, K] (experts: [E, N, K]) float8_e4m3fn
    # [N, 1] fp32 (group_k None) or [ceil(N / group_n), ceil(K / group_k)] fp32 (experts: [E, ...])
    scale: torch.Tensor
    group_n: int
    group_k: int | None
    act_quant: bool
    scale_ub: float | None = None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


@dataclass(frozen=True)
class ActQuant:
    """How a GEMM quantises its input (quantize_groups' arguments): per token and group of `group` columns (a power of
    two), each group's absolute max capped at scale_ub first (None: no cap)."""

    group: int
    scale_ub: float | None = None


@dataclass(frozen=True)
class QuantizedActs:
    """Activations x [M, K] already quantised for a GEMM, bit for bit as quantize_groups(x, quant.group,
    quant.scale_ub) quantises them: what a kernel that writes a GEMM's input hands it in place of x
    (kernels/norm/rmsnorm.py, kernels/norm/gated_act.py), so that no quantiser runs between them (kernels/fp8/gemm.py)."""

    xq: torch.Tensor  # [M, K] float8_e4m3fn, row-major
    scale: torch.Tensor  # [M, ceil(K / quant.group)] fp32, strides (1, M): quantize_groups' column-major layout
    quant: ActQuant
    dtype: torch.dtype  # x's dtype: the GEMM's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.xq.shape


def group_quant_buffers(m: int, k: int, group: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (fp8 [M, K], scales [M, ceil(K / group)] with strides (1, M)): where quantize_groups and the
    kernels that quantise their own output write. Graph-capturable (shapes follow M and K only)."""
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=device)
    scale = torch.empty(-(-k // group), m, dtype=torch.float32, device=device).t()  # [M, G], strides (1, M)
    return q, scale


def _expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], group_n: int, group_k: int | None) -> torch.Tensor:
    """The per-element scale [N, K] (or [N, 1] per channel) of a weight of `shape`, in fp32."""
    n, k = shape
    scale = scale.float()
    if group_k is None:
        return scale  # [N, 1]
    return scale.repeat_interleave(group_n, 0)[:n].repeat_interleave(group_k, 1)[:, :k]


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] fp8 times its scales, computed in fp32 (as transformers' Fp8Dequantize and compressed-tensors'
    decompression do), rounded once to `dtype`. Hazard: materialises a [N, K] tensor of `dtype`."""
    return (weight.float() * _expand_block_scale(scale, tuple(weight.shape), group_n, group_k)).to(dtype)


def quantize_weight(weight: torch.Tensor, group_n: int | None = 128, group_k: int | None = 128
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [N, K], scales) of a float weight: per channel (group_k None: scales [N, 1]) or per block
    (scales [ceil(N / group_n), ceil(K / group_k)]), scale = amax / 448 (1 for an all-zero group). For the bench's
    random weights and tests; checkpoints come quantised."""
    n, k = weight.shape
    w = weight.float()
    if group_k is None:
        amax = w.abs().amax(1, keepdim=True)  # [N, 1]
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    rows, cols = -(-n // group_n), -(-k // group_k)
    padded = w.new_zeros(rows * group_n, cols * group_k)
    padded[:n, :k] = w
    amax = padded.view(rows, group_n, cols, group_k).abs().amax((1, 3))  # [rows, cols]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand_block_scale(scale, (n, k), group_n, group_k)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def gemm_operands(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int,
                  group_k: int | None) -> tuple[int, int, int, int, int, int, int]:
    """Checks the block GEMMs' operands (xq [M, K] fp8 with x_scale [M, ceil(K / BLOCK_K)]; weight [N, K] fp8 with
    its scales; unit column strides) and returns (M, N, K, BLOCK_K = the activation group, stride of a scale row,
    stride of a scale column (0: per channel), group_n)."""
    m, k = xq.shape
    n = weight.shape[0]
    assert weight.dtype == FP8_DTYPE and xq.dtype == FP8_DTYPE and weight.shape[1] == k
    assert weight.stride(1) == 1 and xq.stride(1) == 1
    if group_k is None:  # per-channel [N, 1]: the same scale for every k step
        assert scale.shape == (n, 1)
        block_k, stride_bsn, stride_bsk, group_n = CHANNEL_ACT_GROUP, scale.stride(0), 0, 1
    else:
        assert scale.shape == (-(-n // group_n), -(-k // group_k)), (scale.shape, n, k, group_n, group_k)
        block_k, stride_bsn, stride_bsk = group_k, scale.stride(0), scale.stride(1)
    assert x_scale.shape == (m, -(-k // block_k)), (x_scale.shape, m, k, block_k)
    return m, n, k, block_k, stride_bsn, stride_bsk, group_n


def quantize_groups_ref(x: torch.Tensor, group: int, scale_ub: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantisation, torch: x [M, K] -> (fp8 [M, K], scales [M, ceil(K / group)] fp32). A group
    of K columns (group >= K) is per-token quantisation."""
    m, k = x.shape
    groups = -(-k // group)
    padded = x.float().new_zeros(m, groups * group)
    padded[:, :k] = x.float()
    amax = padded.view(m, groups, group).abs().amax(2)  # [M, G]
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    scale = amax.clamp(min=AMAX_EPS) / FP8_MAX
    q = (padded.view(m, groups, group) / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return q.view(m, -1)[:, :k].to(FP8_DTYPE), scale


def linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int | None,
               bias: torch.Tensor | None = None, act_group: int | None = None,
               scale_ub: float | None = None) -> torch.Tensor:
    """The FP8 linear in torch: x [M, K] -> [M, N] in x's dtype.
    act_group None: F.linear over the weight dequantised to x's dtype, activations as they are: the CPU path, the
    same operation (and rounding) as transformers' linear over a checkpoint it dequantised on load.
    act_group G: W8A8 emulated in fp32, x quantised per token and group of G columns first (what the GPU kernels
    compute, up to accumulation order), rounded once: the kernels' reference."""
    if act_group is None:
        return F.linear(x, dequantize_weight(weight, scale, group_n, group_k, x.dtype), bias)
    w = weight.float() * _expand_block_scale(scale, tuple(weight.shape), group_n, group_k)  # [N, K]
    q, xs = quantize_groups_ref(x, act_group, scale_ub)
    out = (q.float() * xs.repeat_interleave(act_group, 1)[:, :x.shape[1]]) @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


if triton is not None:
    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, num_cols, stride_x, stride_q, scale_ub,
                              HAS_UB: tl.constexpr, BLOCK: tl.constexpr):
        """One program per row: its absolute max over all columns, then the row quantised with it."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, num_cols, BLOCK):
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < num_cols, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        row_max = tl.max(amax, axis=0)
        if HAS_UB:
            row_max = tl.minimum(row_max, scale_ub)
        scale = tl.maximum(row_max, 1e-10) / 448.0
        tl.store(s_ptr + row, scale)
        for start in range(0, num_cols, BLOCK):
            mask = start + cols < num_cols
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
            tl.store(q_ptr + row * stride_q + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor, scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantisation, one Triton kernel: x [M, K] -> (fp8 [M, K], scales [M, 1] fp32), as
    quantize_groups_ref(x, K). Graph-capturable: outputs of x's shape, no host sync."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block = min(4096, triton.next_power_of_2(k))
    _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), scale_ub or 0.0,
                                HAS_UB=scale_ub is not None, BLOCK=block, num_warps=4)
    return q, scale


if triton is not None:
    @triton.jit
    def quantize_group_tile(x, scale_ub, HAS_UB: tl.constexpr):
        """x [G, GROUP] fp32 (zeros past the row's end) -> (q [G, GROUP] fp32 on the fp8 range, scale [G]): each
        group's absolute max (capped at scale_ub), its scale max(amax, 1e-10) / 448 and the group divided by it,
        in IEEE division (as the torch reference). The one arithmetic of every group quantiser here."""
        amax = tl.max(tl.abs(x), axis=1)  # [G]
        if HAS_UB:
            amax = tl.minimum(amax, scale_ub)
        scale = tl.div_rn(tl.maximum(amax, 1e-10), 448.0)
        return tl.clamp(tl.div_rn(x, scale[:, None]), -448.0, 448.0), scale

    @triton.jit
    def quantize_store_row(y, first_col, num_cols, q_row_ptr, s_row_ptr, stride_sg, scale_ub, HAS_UB: tl.constexpr,
                           BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """Columns [first_col, first_col + BLOCK) of one row, y [BLOCK] fp32 (zeros past num_cols), quantised per
        group of GROUP columns as quantize_groups does: the fp8 values to q_row_ptr + column, the scales to
        s_row_ptr + group * stride_sg. first_col and BLOCK: multiples of GROUP. For kernels that quantise the row
        they have just computed (y: its values as rounded to the activation dtype)."""
        groups = first_col // GROUP + tl.arange(0, BLOCK // GROUP)  # [G]
        cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GROUP]
        q, scale = quantize_group_tile(tl.reshape(y, (BLOCK // GROUP, GROUP)), scale_ub, HAS_UB)
        tl.store(q_row_ptr + cols, q.to(q_row_ptr.dtype.element_ty), mask=cols < num_cols)
        tl.store(s_row_ptr + groups * stride_sg, scale, mask=groups * GROUP < num_cols)

    @triton.jit
    def quantize_store_heads(y, heads, heads_ok, q_row_ptr, s_row_ptr, stride_sg, scale_ub, HAS_UB: tl.constexpr,
                             ROWS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr):
        """Several heads of one token's row quantised as quantize_groups quantises the row [H * D]: y [ROWS, D] fp32
        (heads `heads` [ROWS], their values as rounded to the activation dtype), D a multiple of GROUP, so each
        head is D / GROUP whole groups: fp8 to q_row_ptr + head * D + column, scales to s_row_ptr + group *
        stride_sg, for the heads where heads_ok. For the decode attention kernel, whose programs hold a query
        group's heads."""
        q, scale = quantize_group_tile(tl.reshape(y, (ROWS * (D // GROUP), GROUP)), scale_ub, HAS_UB)
        cols = heads[:, None] * D + tl.arange(0, D)[None, :]  # [ROWS, D]
        tl.store(q_row_ptr + cols, tl.reshape(q, (ROWS, D)).to(q_row_ptr.dtype.element_ty), mask=heads_ok[:, None])
        groups = heads[:, None] * (D // GROUP) + tl.arange(0, D // GROUP)[None, :]  # [ROWS, D / GROUP]
        tl.store(s_row_ptr + groups * stride_sg, tl.reshape(scale, (ROWS, D // GROUP)), mask=heads_ok[:, None])

    @triton.jit
    def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, num_cols, stride_x, stride_q, stride_sm, stride_sg, scale_ub,
                                HAS_UB: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr):
        """Program (row, GROUPS_PER_PROG groups): each [GROUP] slice of the row quantised with its own absolute max;
        the scales go to s_ptr + row * stride_sm + group * stride_sg (column-major by default, see below)."""
        row = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)  # [G]
        cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GROUP]
        mask = cols < num_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        q, scale = quantize_group_tile(x, scale_ub, HAS_UB)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups * GROUP < num_cols)


def quantize_groups(x: torch.Tensor, group: int, scale_ub: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group dynamic quantisation, one Triton kernel: x [M, K] -> (fp8 [M, K], scales [M, ceil(K / group)]
    fp32), as quantize_groups_ref(x, group). The scales are COLUMN-major (strides (1, M): a [G, M] buffer
    transposed), the layout cuBLAS's 1x128 block scaling requires (torch._scaled_mm) and the one the Triton GEMM
    reads coalesced (each k step loads BLOCK_M consecutive scales). group: a power of two. Graph-capturable."""
    m, k = x.shape
    assert x.stride(1) == 1 and group & (group - 1) == 0, (x.stride(), group)
    groups = -(-k // group)
    q, scale = group_quant_buffers(m, k, group, x.device)  # [M, K] fp8, [M, G] with strides (1, M)
    per_prog = max(1, min(triton.next_power_of_2(groups), 1024 // group))  # ~1024 elements a program
    _quantize_groups_kernel[(m, triton.cdiv(groups, per_prog))](
        x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1), scale_ub or 0.0,
        HAS_UB=scale_ub is not None, GROUP=group, GROUPS_PER_PROG=per_prog, num_warps=4)
    return q, scale

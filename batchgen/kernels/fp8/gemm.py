"""FP8 GEMMs: out [M, N] = x [M, K] @ dequant(weight [N, K])^T (+ bias), the one entry point the fused decoders'
FP8 projections call (`fp8_linear`). `gemm_path` picks the path, the fastest measured on an H200 (bench/fp8_gemm.py,
README "FP8 checkpoints"):

  - "reference" (CPU, or weights the checkpoint keeps weight-only): fp8_quant.linear_ref, weights dequantised in
    fp32, activations as they are;
  - "rowwise": per-channel weight scales on CUDA, bf16 activations, K and N multiples of 16: x quantised per token
    (fp8_quant.quantize_rows), then torch._scaled_mm with row-wise scales (cuBLASLt on sm90; bf16 output only);
  - "blockwise": cuBLASLt's block-wise torch._scaled_mm where it fits and its probe passes (kernels/fp8/blockwise.py);
  - "triton" (every other block scale: other block sizes, per-row blocks of fused parts, fp16/fp32 activations,
    GPUs or torch builds without block-wise _scaled_mm; and per-channel scales with fp16/fp32 activations):
    `block_scaled_matmul`, two launches as vLLM's w8a8_block_fp8_matmul: x quantised ONCE per GEMM per token and
    group of group_k columns (quantize_groups: fp8 [M, K] + scales [M, K / group_k]), then `w8a8_matmul`, a
    Triton kernel that loads fp8 A and B tiles, tl.dot fp8 x fp8 -> fp32, times a_scale[:, None] *
    b_scale[None, :] per k block. (The first version fused the quantisation into the GEMM: every column program
    re-quantised the same [BLOCK_M, 128] tile with fp32 divides, N / BLOCK_N times; at M >= 256 that elementwise
    work dominated.)
  - "splitk" (block scales, M <= SPLITK_MAX_ROWS or a shape's SPLITK_SHAPE_ROWS, ahead of "blockwise" and
    "triton"): the same quantiser, then kernels/fp8/splitk.py's split-K GEMM (programs over row tiles x column
    tiles x K ranges of whole scale blocks, >= 2 per SM, fp32 partials summed in a fixed order by a second kernel),
    for decode, where the one-program-per-column-tile GEMMs stream the weight at 1.0-1.4 TB/s. Measured on the
    H200 (2026-12-01, W1 at 32 rows, forced paths in one run): split-K 5.27 s against the Triton GEMM's 6.20 s;
    cuBLAS block-wise did not pass its probe there.

Where the kernel that writes a GEMM's input quantises it itself (`input_quant` says how, for a weight and M: the
fused decoders' RMSNorms and gated activation), fp8_linear takes its QuantizedActs and runs the path's GEMM alone.

Launch configs of the Triton GEMM: CONFIGS, one per M bucket (the largest M it covers), replaced for the weight
shapes and M buckets `python3 bench/fp8_gemm.py --sweep` measured better by SHAPE_CONFIGS (gemm_launches.json,
read once at import; no environment variable); a default config whose grid would not fill the GPU's SMs narrows
its column tile (down to 32). bench/fp8_gemm.py passes explicit configs to the functions it times.

Every path is CUDA-graph capturable: no host syncs, outputs whose shapes follow x's and the weight's only. The
one probe (fp8_blockwise.blockwise_scaled_mm_supported) syncs once per device, before any capture.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from batchgen.kernels.fp8 import blockwise as fp8_blockwise
from batchgen.kernels.fp8 import gemm_table
from batchgen.kernels.fp8.quant import (CHANNEL_ACT_GROUP, ActQuant, Fp8Weight, QuantizedActs, gemm_operands,
                                        linear_ref, quantize_groups, quantize_rows)
from batchgen.kernels.fp8.splitk import num_sms as _num_sms, splitk_matmul
from batchgen.kernels.fp8.splitk_common import SplitKPartials

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    group_m: int  # M tiles walked together over one column of N tiles (weight tile reuse from L2)
    warps: int
    stages: int


# M bucket (the largest M it covers; the last one: everything above) -> config. Decode (M <= 64) is weight
# bandwidth bound: small BLOCK_M (16: two M tiles at M 32 double the programs, A is fp8 and tiny) and deep
# pipelining; prefill / large batches: 64x128 tiles as vLLM's tuned H100/H200 tables pick for K 4096-7168.
CONFIGS: dict[int, GemmConfig] = {
    16: GemmConfig(16, 64, 8, 4, 5),
    32: GemmConfig(16, 64, 8, 4, 5),
    64: GemmConfig(32, 64, 8, 4, 4),
    128: GemmConfig(64, 64, 8, 4, 4),
    256: GemmConfig(64, 128, 8, 4, 3),
    512: GemmConfig(64, 128, 8, 4, 3),
    1 << 62: GemmConfig(128, 128, 8, 8, 3),
}
# The split-K GEMM (kernels/fp8/splitk.py) for block-scaled weights at M <= this many rows: the largest M at which
# a GPU run measured it faster end to end (W1's 32 rows, 2026-12-01: 5.27 s vs the Triton GEMM's 6.20 s). Above it
# the block-wise _scaled_mm where its probe passes, else the Triton GEMM; unless SPLITK_SHAPE_ROWS lists the
# weight's shape.
SPLITK_MAX_ROWS = 32
# Measured per weight shape (gemm_launches.json, read once: gemm_table.py): SHAPE_CONFIGS, (N, K) -> {M bucket:
# config} where the sweep found a config faster than CONFIGS' (only the buckets listed: an M above the largest takes
# CONFIGS); SPLITK_SHAPE_ROWS, (N, K) -> the most rows at which split-K takes that shape beyond SPLITK_MAX_ROWS.
SHAPE_CONFIGS, SPLITK_SHAPE_ROWS = gemm_table.load(GemmConfig)


def _bucket(table: dict[int, GemmConfig], m: int) -> GemmConfig:
    for bound in sorted(table):
        if m <= bound:
            return table[bound]
    return table[max(table)]


def gemm_config(m: int, n: int, k: int, num_sms: int | None = None) -> GemmConfig:
    """The Triton GEMM's launch config for x [m, k] @ w [n, k]^T (see the module docstring)."""
    tuned = SHAPE_CONFIGS.get((n, k), {})
    if m <= max(tuned, default=0):
        return _bucket(tuned, m)
    cfg = _bucket(CONFIGS, m)
    if num_sms:  # fill at least one wave of programs: narrower column tiles
        block_n = cfg.block_n
        while block_n > 32 and -(-n // block_n) * -(-m // cfg.block_m) < num_sms:
            block_n //= 2
        cfg = cfg._replace(block_n=block_n)
    return cfg


if triton is not None:
    from batchgen.kernels.fp8.splitk import scaled_block_tile

    @triton.jit
    def _w8a8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_asm,
                          stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cm, group_n,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """C [M, N] = sum over k blocks of (A_fp8 @ B_fp8^T)[block] * a_scale[m, kb] * b_scale[n // group_n, kb].
        One program per (BLOCK_M, BLOCK_N) tile, ordered GROUP_M M tiles at a time down each column of tiles.
        BLOCK_K is the activation group and the weight's group_k (stride_bsk 0: per-channel weight scales)."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_pid_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        scaled_block_tile(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, pid_m, pid_n, 0, tl.cdiv(K, BLOCK_K), M, N,
                          K, stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cm, group_n,
                          HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K)


def w8a8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int,
                group_k: int | None, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                config: GemmConfig | tuple | None = None) -> torch.Tensor:
    """The Triton GEMM over already-quantised activations: xq [M, K] fp8 with x_scale [M, ceil(K / G)] (any
    strides; G = group_k, or CHANNEL_ACT_GROUP for per-channel weights) -> [M, N] in out_dtype."""
    m, n, k, block_k, stride_bsn, stride_bsk, group_n = gemm_operands(xq, x_scale, weight, scale, group_n, group_k)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    if config is None:
        cfg = gemm_config(m, n, k, _num_sms(xq.device.index or 0) if xq.is_cuda else None)
    else:
        cfg = GemmConfig(*config)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _w8a8_gemm_kernel[grid](xq, x_scale, weight, scale, bias if bias is not None else scale, out, m, n, k,
                            xq.stride(0), x_scale.stride(0), x_scale.stride(1), weight.stride(0), stride_bsn,
                            stride_bsk, out.stride(0), group_n, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
                            BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m, num_warps=cfg.warps,
                            num_stages=cfg.stages)
    return out


def block_scaled_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int,
                        group_k: int | None, bias: torch.Tensor | None = None, scale_ub: float | None = None,
                        config: GemmConfig | tuple | None = None) -> torch.Tensor:
    """W8A8 with block (or per-channel: group_k None, activations then quantised per CHANNEL_ACT_GROUP columns)
    weight scales: x [M, K] (bf16/fp16/fp32) quantised per token group (one kernel), then the Triton GEMM
    (w8a8_matmul) -> [M, N] in x's dtype."""
    xq, x_scale = quantize_groups(x, group_k or CHANNEL_ACT_GROUP, scale_ub)
    return w8a8_matmul(xq, x_scale, weight, scale, group_n, group_k, x.dtype, bias, config)


def rowwise_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale_row: torch.Tensor,
                      bias: torch.Tensor | None = None, scale_ub: float | None = None) -> torch.Tensor:
    """W8A8 with per-channel weight scales: x quantised per token (one Triton kernel), then torch._scaled_mm with
    row-wise scales. x [M, K] bf16, weight [N, K] fp8, scale_row [1, N] fp32 -> [M, N] bf16. Hazard: on CUDA
    _scaled_mm needs K and N multiples of 16 and bf16 output for row-wise scales."""
    xq, x_scale = quantize_rows(x, scale_ub)  # [M, K] fp8, [M, 1]
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale_row, out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


FORCED_PATHS = ("blockwise", "triton", "splitk")  # engine.fp8_gemm's values besides "auto"


def forced_path(path: str, auto: str, device: torch.device, dtype: torch.dtype, n: int, k: int, group_n: int,
                group_k: int | None) -> str:
    """The path a GEMM takes under engine.fp8_gemm `path`, given gemm_path's `auto` choice: a forced path applies
    where the auto choice is one of the block-scaled paths (so CPU, weight-only and per-channel weights keep
    theirs); "blockwise" where cuBLASLt cannot take these scales raises, naming the key."""
    if path == "auto" or auto not in FORCED_PATHS:
        return auto
    if path not in FORCED_PATHS:
        raise ValueError(f"engine.fp8_gemm: {path!r} is not one of auto, {', '.join(FORCED_PATHS)}")
    if path == "blockwise" and not fp8_blockwise.blockwise_scaled_mm_fits(dtype, n, k, group_n, group_k):
        raise ValueError(f"engine.fp8_gemm: blockwise: cuBLASLt's block-wise _scaled_mm cannot take this weight "
                         f"([{n}, {k}], {dtype}, scale blocks {group_n} x {group_k}: it needs 128 x 128 blocks, bf16, "
                         f"K and N multiples of 16 and K / 128 a multiple of 4); use auto, triton or splitk")
    fp8_blockwise.refuse_unavailable(path, _device_index(device))
    return path


def gemm_path(device: torch.device, dtype: torch.dtype, n: int, k: int, group_n: int, group_k: int | None,
              act_quant: bool, rows: int | None = None) -> str:
    """Which path fp8_linear takes for `rows` (None: any count) activations of `dtype` on `device` times a weight
    [n, k] with these scales: "reference", "rowwise", "splitk", "blockwise" or "triton" (see the module docstring)."""
    if device.type != "cuda" or not act_quant or triton is None:
        return "reference"
    if group_k is None and dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0:
        return "rowwise"
    splitk_rows = max(SPLITK_MAX_ROWS, SPLITK_SHAPE_ROWS.get((n, k), 0))
    if group_k is not None and rows is not None and 0 < rows <= splitk_rows:
        return "splitk"
    if fp8_blockwise.blockwise_scaled_mm_fits(dtype, n, k, group_n, group_k) and \
            fp8_blockwise.blockwise_scaled_mm_supported(_device_index(device)):
        return "blockwise"
    return "triton"


def describe_paths(device: torch.device, dtype: torch.dtype, group_n: int, group_k: int | None, act_quant: bool,
                   path: str = "auto") -> str:
    """The FP8 GEMMs a checkpoint of these scales runs on `device` under engine.fp8_gemm `path`, in words for the
    start-up line (a real checkpoint's layers: 128-multiple shapes), with the block-wise probe's reason where it
    said no."""
    if device.type != "cuda" or triton is None:
        return "FP8 weights dequantised (CPU reference)"
    if not act_quant:
        return "FP8 weights dequantised (a weight-only checkpoint)"
    if group_k is None:
        return "FP8 GEMMs: row-wise _scaled_mm" if dtype == torch.bfloat16 else "FP8 GEMMs: Triton"
    if path != "auto":
        return f"FP8 GEMMs: {path} (engine.fp8_gemm) at every batch size"
    above = gemm_path(device, dtype, 4096, 4096, group_n, group_k, act_quant)
    why = fp8_blockwise.blockwise_unsupported_reason(_device_index(device)) if above == "triton" else ""
    shapes = "".join(f", {n}x{k} to {rows}" for (n, k), rows in SPLITK_SHAPE_ROWS.items() if rows > SPLITK_MAX_ROWS)
    return (f"FP8 GEMMs: split-K at <= {SPLITK_MAX_ROWS} rows{shapes}, "
            f"{'cuBLASLt block-wise' if above == 'blockwise' else 'Triton'} above"
            f"{f' (block-wise _scaled_mm off: {why})' if why else ''}")


GROUP_PATHS = ("splitk", "blockwise", "triton")  # the paths whose GEMM reads quantize_groups' output


def choose_path(device: torch.device, dtype: torch.dtype, n: int, k: int, group_n: int, group_k: int | None,
                act_quant: bool, rows: int, path: str = "auto") -> str:
    """The path fp8_linear takes for `rows` activations of `dtype` on `device`: gemm_path's choice under
    engine.fp8_gemm `path` (forced_path)."""
    auto = gemm_path(device, dtype, n, k, group_n, group_k, act_quant, rows)
    return forced_path(path, auto, device, dtype, n, k, group_n, group_k)


def input_quant(weight: Fp8Weight, rows: int, dtype: torch.dtype, device: torch.device,
                path: str = "auto") -> ActQuant | None:
    """How fp8_linear would quantise an input of `rows` rows of `dtype` on `device` for `weight`, where the kernel
    writing that input can do it instead (handing fp8_linear QuantizedActs): quantize_groups' arguments for a
    block-scaled weight whose path reads quantize_groups' output (split-K, cuBLASLt block-wise, Triton); None where
    the input is taken as it is (reference), or quantised per token (row-wise) or per CHANNEL_ACT_GROUP columns."""
    n, k = weight.shape
    if weight.group_k is None:
        return None
    chosen = choose_path(device, dtype, n, k, weight.group_n, weight.group_k, weight.act_quant, rows, path)
    return ActQuant(weight.group_k, weight.scale_ub) if chosen in GROUP_PATHS else None


def _grouped_gemm(path: str, xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  group_n: int, group_k: int | None, bias: torch.Tensor | None, out_dtype: torch.dtype,
                  unreduced: bool) -> torch.Tensor | SplitKPartials:
    """The GEMM of a GROUP_PATHS path over quantize_groups' output (xq [M, K] fp8, x_scale [M, G]) -> [M, N]
    (split-K with `unreduced`: possibly its partials, see fp8_splitk.splitk_matmul)."""
    if path == "blockwise":
        return fp8_blockwise.blockwise_matmul(xq, x_scale, weight, scale, out_dtype, bias)
    if path == "splitk":
        return splitk_matmul(xq, x_scale, weight, scale, group_n, group_k, out_dtype, bias, unreduced=unreduced)
    return w8a8_matmul(xq, x_scale, weight, scale, group_n, group_k, out_dtype, bias)


def fp8_linear(x: torch.Tensor | QuantizedActs, weight: torch.Tensor, scale: torch.Tensor, group_n: int,
               group_k: int | None, bias: torch.Tensor | None = None, act_quant: bool = True,
               scale_ub: float | None = None, path: str = "auto", unreduced: bool = False
               ) -> torch.Tensor | SplitKPartials:
    """x [..., K] @ dequant(weight [N, K])^T + bias -> [..., N] in x's dtype, by choose_path's choice. act_quant
    False: a weight-only checkpoint, the reference path everywhere. `path` (engine.fp8_gemm) "blockwise", "triton"
    or "splitk": that path for block-scaled weights on CUDA at every M (others: gemm_path's choice).
    x QuantizedActs [M, K]: quantised by the kernel that wrote it, as input_quant said for this weight and M; the
    path's GEMM reads it in place of quantize_groups' output (the same bits: the same result).
    `unreduced` (x of 2 dims): a split-K GEMM of several splits returns its partials unsummed (SplitKPartials)."""
    n, k = weight.shape
    if isinstance(x, QuantizedActs):
        path = choose_path(x.xq.device, x.dtype, n, k, group_n, group_k, act_quant, x.shape[0], path)
        assert path in GROUP_PATHS and x.quant == ActQuant(group_k, scale_ub), (path, x.quant, group_k, scale_ub)
        return _grouped_gemm(path, x.xq, x.scale, weight, scale, group_n, group_k, bias, x.dtype, unreduced)
    assert x.dim() == 2 or not unreduced
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    path = choose_path(x.device, x.dtype, n, k, group_n, group_k, act_quant, x2.shape[0], path)
    if path == "reference":
        out = linear_ref(x2, weight, scale, group_n, group_k, bias)
    elif path == "rowwise":
        out = rowwise_scaled_mm(x2, weight, scale.view(1, -1), bias, scale_ub)
    else:  # one of GROUP_PATHS
        xq, x_scale = quantize_groups(x2, group_k or CHANNEL_ACT_GROUP, scale_ub)
        out = _grouped_gemm(path, xq, x_scale, weight, scale, group_n, group_k, bias, x.dtype, unreduced)
        if isinstance(out, SplitKPartials):
            return out
    return out.reshape(*x.shape[:-1], n)

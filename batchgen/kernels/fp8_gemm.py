"""FP8 GEMMs: out [M, N] = x [M, K] @ dequant(weight [N, K])^T (+ bias), the one entry point the fused decoders'
FP8 projections call (`fp8_linear`), with these paths:

  - reference (CPU, or weights the checkpoint keeps weight-only): fp8_quant.linear_ref, weights dequantised in
    fp32, activations as they are;
  - per-channel weight scales on CUDA, bf16 activations: x quantised per token (fp8_quant.quantize_rows), then
    torch._scaled_mm with row-wise scales (cuBLASLt on sm90; bf16 output only);
  - block weight scales (and per-channel ones with fp16/fp32 activations): `block_scaled_matmul`, two launches as
    vLLM's w8a8_block_fp8_matmul: x quantised ONCE per GEMM per token and group of group_k columns
    (fp8_quant.quantize_groups: fp8 [M, K] + scales [M, K / group_k]), then `w8a8_matmul`, a Triton kernel that
    loads fp8 A and B tiles, tl.dot fp8 x fp8 -> fp32, times a_scale[:, None] * b_scale[None, :] per k block.
    (The first version fused the quantisation into the GEMM: every column program re-quantised the same
    [BLOCK_M, 128] tile with fp32 divides, N / BLOCK_N times; at M >= 256 that elementwise work dominated.)
    Optionally (BATCHGEN_FP8_GEMM=cublas, 128x128 blocks, bf16, where torch's cuBLASLt supports it: sm90, CUDA
    >= 12.9) the same quantised x goes to torch._scaled_mm with 1x128 x 128x128 block-wise scales instead.

Launch configs of the Triton GEMM: CONFIGS, one per M bucket (the largest M it covers), overridden per weight
shape by SHAPE_CONFIGS, which `python3 bench/fp8_gemm.py --sweep` prints from measured times (or loads from its
--json report: BATCHGEN_FP8_CONFIGS=report.json); a default config
whose grid would not fill the GPU's SMs narrows its column tile (down to 32).

Every path is CUDA-graph capturable: no host syncs, outputs whose shapes follow x's and the weight's only.
"""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch

from batchgen.kernels.fp8_quant import FP8_DTYPE, linear_ref, quantize_groups, quantize_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton (CPU) use the reference
    triton = None

CHANNEL_ACT_GROUP = 128  # activation group of the Triton kernel over per-channel weights (group_k None)
# "triton" (default) or "cublas": the block-scaled GEMM's backend (cublas only where supported, else triton)
BLOCK_GEMM_BACKEND = os.environ.get("BATCHGEN_FP8_GEMM", "triton")


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
# (N, K) -> {M bucket: config}: measured per shape (bench/fp8_gemm.py --sweep prints this dict). Used as is.
SHAPE_CONFIGS: dict[tuple[int, int], dict[int, GemmConfig]] = {}


def load_shape_configs(path: str) -> None:
    """Add the best configs of a `bench/fp8_gemm.py --sweep --json PATH` report to SHAPE_CONFIGS (what
    BATCHGEN_FP8_CONFIGS=PATH does at import): tuned configs for an engine run before they are committed."""
    with open(path) as f:
        for s in json.load(f)["sweep"]:
            SHAPE_CONFIGS.setdefault((s["N"], s["K"]), {})[s["M"]] = GemmConfig(*s["best"])


if os.environ.get("BATCHGEN_FP8_CONFIGS"):
    load_shape_configs(os.environ["BATCHGEN_FP8_CONFIGS"])


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _bucket(table: dict[int, GemmConfig], m: int) -> GemmConfig:
    for bound in sorted(table):
        if m <= bound:
            return table[bound]
    return table[max(table)]


def gemm_config(m: int, n: int, k: int, num_sms: int | None = None) -> GemmConfig:
    """The Triton GEMM's launch config for x [m, k] @ w [n, k]^T (see the module docstring)."""
    tuned = SHAPE_CONFIGS.get((n, k))
    if tuned:
        return _bucket(tuned, m)
    cfg = _bucket(CONFIGS, m)
    if num_sms:  # fill at least one wave of programs: narrower column tiles
        block_n = cfg.block_n
        while block_n > 32 and -(-n // block_n) * -(-m // cfg.block_m) < num_sms:
            block_n //= 2
        cfg = cfg._replace(block_n=block_n)
    return cfg


if triton is not None:
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
        # rows / columns past the edge wrap (loads stay in bounds, unmasked); their outputs are not stored
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        as_ptrs = as_ptr + offs_m * stride_asm
        bs_ptrs = bs_ptr + (offs_n // group_n) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            a_s = tl.load(as_ptrs + kb * stride_ask)
            b_s = tl.load(bs_ptrs + kb * stride_bsk)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


def _weight_scale_strides(weight: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int | None
                          ) -> tuple[int, int, int, int]:
    """(BLOCK_K = activation group, stride of a scale row, stride of a scale column (0: per channel), group_n)."""
    n, k = weight.shape
    if group_k is None:  # per-channel [N, 1]: the same scale for every k step
        assert scale.shape == (n, 1)
        return CHANNEL_ACT_GROUP, scale.stride(0), 0, 1
    assert scale.shape == (-(-n // group_n), -(-k // group_k)), (scale.shape, n, k, group_n, group_k)
    return group_k, scale.stride(0), scale.stride(1), group_n


def w8a8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int,
                group_k: int | None, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                config: GemmConfig | tuple | None = None) -> torch.Tensor:
    """The Triton GEMM over already-quantised activations: xq [M, K] fp8 with x_scale [M, ceil(K / G)] (any
    strides; G = group_k, or CHANNEL_ACT_GROUP for per-channel weights) -> [M, N] in out_dtype."""
    m, k = xq.shape
    n = weight.shape[0]
    assert weight.dtype == FP8_DTYPE and xq.dtype == FP8_DTYPE and weight.shape[1] == k
    assert weight.stride(1) == 1 and xq.stride(1) == 1
    block_k, stride_bsn, stride_bsk, group_n = _weight_scale_strides(weight, scale, group_n, group_k)
    assert x_scale.shape == (m, -(-k // block_k)), (x_scale.shape, m, k, block_k)
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


@functools.lru_cache(maxsize=None)
def blockwise_scaled_mm_supported(device_index: int = 0) -> bool:
    """Whether torch._scaled_mm takes 1x128 x 128x128 block-wise fp32 scales on this GPU (sm90, torch with
    cuBLASLt >= 12.9): one small call, no sync; any error means no. Call it outside graph capture first."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    try:
        dev = torch.device("cuda", device_index)
        # K / 128 = 4: newer torch wants the 128x128 scale's row stride rounded up to a multiple of 4
        a = torch.zeros(16, 512, device=dev).to(FP8_DTYPE)
        w = torch.zeros(128, 512, device=dev).to(FP8_DTYPE)
        sa = torch.ones(4, 16, device=dev).t()  # [M, K / 128], strides (1, M)
        sw = torch.ones(1, 4, device=dev)  # [N / 128, K / 128]
        torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw.t(), out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


def blockwise_scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor, group_n: int, group_k: int | None) -> bool:
    """The shapes and dtypes the cuBLASLt block-wise path takes (checkpoint 128x128 blocks, bf16, K and N
    multiples of 16 as _scaled_mm needs; the weight scale's columns a multiple of 4 for its 128x128 layout)."""
    n, k = weight.shape
    return (group_n == 128 and group_k == 128 and x.dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0
            and (-(-k // 128)) % 4 == 0)


def blockwise_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None = None, scale_ub: float | None = None) -> torch.Tensor:
    """W8A8 with 128x128 block weight scales through torch._scaled_mm (cuBLASLt): x [M, K] bf16 quantised per
    token and 128 columns (quantize_groups: its column-major scales are cuBLAS's 1x128 layout), the weight's
    [N / 128, K / 128] row-major scales transposed as its 128x128 layout. Only where blockwise_scaled_mm_supported."""
    xq, x_scale = quantize_groups(x, 128, scale_ub)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)


def rowwise_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale_row: torch.Tensor,
                      bias: torch.Tensor | None = None, scale_ub: float | None = None) -> torch.Tensor:
    """W8A8 with per-channel weight scales: x quantised per token (one Triton kernel), then torch._scaled_mm with
    row-wise scales. x [M, K] bf16, weight [N, K] fp8, scale_row [1, N] fp32 -> [M, N] bf16. Hazard: on CUDA
    _scaled_mm needs K and N multiples of 16 and bf16 output for row-wise scales."""
    xq, x_scale = quantize_rows(x, scale_ub)  # [M, K] fp8, [M, 1]
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale_row, out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int | None,
               bias: torch.Tensor | None = None, act_quant: bool = True, scale_ub: float | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K])^T + bias -> [..., N] in x's dtype: the path for the device (see the
    module docstring). act_quant False: a weight-only checkpoint, the reference path everywhere."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if not x.is_cuda or not act_quant or triton is None:
        out = linear_ref(x2, weight, scale, group_n, group_k, bias)
    elif group_k is None and x.dtype == torch.bfloat16:
        out = rowwise_scaled_mm(x2, weight, scale.view(1, -1), bias, scale_ub)
    elif (BLOCK_GEMM_BACKEND == "cublas" and blockwise_scaled_mm_fits(x2, weight, group_n, group_k)
          and blockwise_scaled_mm_supported(x.device.index or 0)):
        out = blockwise_scaled_mm(x2, weight, scale, bias, scale_ub)
    else:
        out = block_scaled_matmul(x2, weight, scale, group_n, group_k, bias, scale_ub)
    return out.reshape(*x.shape[:-1], weight.shape[0])

"""FP8 GEMMs: out [M, N] = x [M, K] @ dequant(weight [N, K])^T (+ bias), the one entry point the fused decoders'
FP8 projections call (`fp8_linear`). `gemm_path` picks the path, the fastest measured on an H200 (bench/fp8_gemm.py,
README "FP8 checkpoints"):

  - "reference" (CPU, or weights the checkpoint keeps weight-only): fp8_quant.linear_ref, weights dequantised in
    fp32, activations as they are;
  - "rowwise": per-channel weight scales on CUDA, bf16 activations, K and N multiples of 16: x quantised per token
    (fp8_quant.quantize_rows), then torch._scaled_mm with row-wise scales (cuBLASLt on sm90; bf16 output only);
  - "blockwise": 128x128 block weight scales, bf16, where torch's cuBLASLt takes 1x128 x 128x128 block-wise scales
    (blockwise_scaled_mm_fits and blockwise_scaled_mm_supported: sm90, CUDA >= 12.9): x quantised once per token
    and group of 128 columns (fp8_quant.quantize_groups: its column-major scales are cuBLAS's 1x128 layout), then
    torch._scaled_mm with the weight's block scales. Fastest at every layer shape and M measured;
  - "triton" (every other block scale: other block sizes, per-row blocks of fused parts, fp16/fp32 activations,
    GPUs or torch builds without block-wise _scaled_mm; and per-channel scales with fp16/fp32 activations):
    `block_scaled_matmul`, two launches as vLLM's w8a8_block_fp8_matmul: x quantised ONCE per GEMM per token and
    group of group_k columns (quantize_groups: fp8 [M, K] + scales [M, K / group_k]), then `w8a8_matmul`, a
    Triton kernel that loads fp8 A and B tiles, tl.dot fp8 x fp8 -> fp32, times a_scale[:, None] *
    b_scale[None, :] per k block. (The first version fused the quantisation into the GEMM: every column program
    re-quantised the same [BLOCK_M, 128] tile with fp32 divides, N / BLOCK_N times; at M >= 256 that elementwise
    work dominated.)
  - "splitk" (block scales, M <= SPLITK_MAX_ROWS, ahead of "blockwise" and "triton"): the same quantiser, then
    kernels/fp8_splitk.py's split-K GEMM (programs over column tiles x K ranges of whole scale blocks, >= 2 per SM,
    fp32 partials summed in a fixed order by a second kernel), for decode, where the one-program-per-column-tile
    GEMMs stream the weight at 1.0-1.4 TB/s. Measured on the H200 (session 11, W1 at 32 rows, forced paths in one
    run): split-K 5.27 s against the Triton GEMM's 6.20 s; cuBLAS block-wise did not pass its probe there.

Launch configs of the Triton GEMM: CONFIGS, one per M bucket (the largest M it covers), replaced for the weight
shapes and M buckets `python3 bench/fp8_gemm.py --sweep` measured better by SHAPE_CONFIGS (committed here: no
environment variable or file read at import); a default config whose grid would not fill the GPU's SMs narrows
its column tile (down to 32). bench/fp8_gemm.py passes explicit configs to the functions it times.

Every path is CUDA-graph capturable: no host syncs, outputs whose shapes follow x's and the weight's only. The
one probe (blockwise_scaled_mm_supported) runs a few tiny GEMMs and syncs once per device; it refuses to run
inside a capture, and the decoders' build runs it first (models/registry.build_decode_forward).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from batchgen.kernels.fp8_quant import (CHANNEL_ACT_GROUP, gemm_operands, linear_ref, quantize_groups,
                                        quantize_groups_ref, quantize_rows, quantize_weight)
from batchgen.kernels.fp8_splitk import num_sms as _num_sms, splitk_scaled_matmul

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
# (N, K) -> {M bucket: config}: where bench/fp8_gemm.py --sweep measured a config faster than the default (one
# H200, CUDA-graph replays of the GEMM alone). Only the buckets listed: an M above the largest
# takes CONFIGS (the sweep found the defaults best for these shapes at M = 256). Llama-3.1-8B-sized layers:
SHAPE_CONFIGS: dict[tuple[int, int], dict[int, GemmConfig]] = {
    (6144, 4096): {32: GemmConfig(16, 32, 8, 4, 4)},  # q/k/v fused: 0.0182 ms vs the default's 0.0220 at M 32
    (28672, 4096): {32: GemmConfig(32, 64, 8, 4, 4)},  # gate/up fused: 0.0420 ms vs 0.0602 at M 32
}
# The split-K GEMM (kernels/fp8_splitk.py) for block-scaled weights at M <= this many rows: the largest M at which
# a GPU run measured it faster end to end (W1's 32 rows, session 11: 5.27 s vs the Triton GEMM's 6.20 s). Above it
# (64 rows untimed) the block-wise _scaled_mm where its probe passes, else the Triton GEMM.
SPLITK_MAX_ROWS = 32


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
    from batchgen.kernels.fp8_splitk import scaled_block_tile

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


# The probe's answer per CUDA device index: the one piece of mutable module state here, on purpose. The probe
# runs tiny GEMMs and syncs, so it must run once per device, outside any CUDA-graph capture, and the answer
# cannot change while the process lives (it depends on the GPU and the torch / cuBLASLt build only). Tests
# monkeypatch blockwise_scaled_mm_supported itself rather than writing here.
_BLOCKWISE_SUPPORTED: dict[int, bool] = {}
_BLOCKWISE_WHY_NOT: dict[int, str] = {}  # device index -> why the probe said no (the error, or the wrong result)


def blockwise_scaled_mm_supported(device_index: int) -> bool:
    """Whether torch._scaled_mm computes W8A8 with 1x128 x 128x128 block-wise fp32 scales correctly on CUDA device
    `device_index` (sm90, torch with cuBLASLt >= 12.9). Probed on first use for that device, then cached: tiny
    GEMMs at M = 1, 3 and 16 (one row, an odd row count and an aligned one: decode and prefill row counts),
    compared with the fp32 reference (a host sync). Any error, or a wrong result, means no.
    Raises RuntimeError if first called during CUDA-graph capture (a sync there would break the capture): the
    decoders' build calls it before any capture (models/registry.build_decode_forward), and the fused decoder's
    first-step check and the graphs' warm-up steps run every GEMM eagerly before capturing it."""
    if device_index in _BLOCKWISE_SUPPORTED:
        return _BLOCKWISE_SUPPORTED[device_index]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device_index) != (9, 0):
        why_not = "not an sm90 GPU"
    else:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("batchgen: the block-wise _scaled_mm probe ran inside a CUDA-graph capture; call "
                               "kernels.fp8_gemm.blockwise_scaled_mm_supported(device) before capturing")
        why_not = _probe_blockwise(torch.device("cuda", device_index))
    _BLOCKWISE_SUPPORTED[device_index] = not why_not
    if why_not:
        _BLOCKWISE_WHY_NOT[device_index] = why_not
    return not why_not


def blockwise_unsupported_reason(device_index: int) -> str:
    """Why block-wise _scaled_mm is off on this device (probing it first, see blockwise_scaled_mm_supported), or ""
    where it is on: the probe's error or wrong result, for messages and bench reports."""
    if blockwise_scaled_mm_supported(device_index):
        return ""
    return _BLOCKWISE_WHY_NOT.get(device_index, "the probe said no")


def _probe_blockwise(dev: torch.device) -> str:
    """One tiny blockwise_scaled_mm per row count, checked against the emulated W8A8 reference (torch ops only:
    no Triton, the activations quantised by the torch reference into the layout quantize_groups writes).
    Returns "" where every row count is right, else why not (the error's type and first line, or the error)."""
    g = torch.Generator().manual_seed(0)
    n, k = 128, 512  # K / 128 = 4: the weight scale's row stride, a multiple of 4 as cuBLASLt's 128x128 layout needs
    w, w_scale = quantize_weight(torch.randn(n, k, generator=g), 128, 128)
    try:
        w, w_scale = w.to(dev), w_scale.to(dev)
        for m in (1, 3, 16):
            x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
            xq, x_scale = quantize_groups_ref(x, 128)
            x_scale = x_scale.t().contiguous().t()  # [M, K / 128], strides (1, M): cuBLAS's 1x128 layout
            out = _blockwise_mm(xq, x_scale, w, w_scale, torch.bfloat16)
            ref = linear_ref(x, w, w_scale, 128, 128, act_group=128).float()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            if not err <= 1e-2:
                return f"wrong result at M = {m}: relative error {err:.3g} against the W8A8 reference"
        return ""
    except (RuntimeError, TypeError, ValueError) as e:
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        return f"torch._scaled_mm raised {type(e).__name__}: {first_line}"


def blockwise_scaled_mm_fits(dtype: torch.dtype, n: int, k: int, group_n: int, group_k: int | None) -> bool:
    """The shapes and dtypes the cuBLASLt block-wise path takes for a weight [n, k]: checkpoint 128x128 blocks,
    bf16 activations, K and N multiples of 16 as _scaled_mm needs, and the weight scale's columns (K / 128) a
    multiple of 4 for its 128x128 layout."""
    return (group_n == 128 and group_k == 128 and dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0
            and (-(-k // 128)) % 4 == 0)


def _blockwise_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm with 1x128 activation and 128x128 weight block scales: xq [M, K] fp8 with x_scale [M, K / 128]
    (strides (1, M)), weight [N, K] fp8 with scale [N / 128, K / 128] row-major -> [M, N]. Hazard: cuBLASLt's
    block-wise kernels need M a multiple of 4 and torch does not check it (a wrong result or an error, not a
    message; vLLM and TransformerEngine pad likewise): other row counts run padded with zero rows of scale 1, and
    the padding's output rows are dropped."""
    m, k = xq.shape
    padded_m = -(-m // 4) * 4
    if padded_m != m:
        xq_padded = xq.new_zeros(padded_m, k)
        xq_padded[:m] = xq
        scale_padded = x_scale.new_ones(x_scale.shape[1], padded_m).t()  # [Mp, K / 128], strides (1, Mp)
        scale_padded[:m] = x_scale
        xq, x_scale = xq_padded, scale_padded
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=out_dtype)
    return out if padded_m == m else out[:m]


def blockwise_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None = None, scale_ub: float | None = None) -> torch.Tensor:
    """W8A8 with 128x128 block weight scales through torch._scaled_mm (cuBLASLt): x [M, K] bf16 quantised per
    token and 128 columns (quantize_groups: its column-major scales are cuBLAS's 1x128 layout), the weight's
    [N / 128, K / 128] row-major scales transposed as its 128x128 layout (_blockwise_mm). Only where
    blockwise_scaled_mm_supported."""
    xq, x_scale = quantize_groups(x, 128, scale_ub)
    out = _blockwise_mm(xq, x_scale, weight, scale, x.dtype)
    return out if bias is None else out.add_(bias)


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
    if path == "blockwise" and not blockwise_scaled_mm_fits(dtype, n, k, group_n, group_k):
        raise ValueError(f"engine.fp8_gemm: blockwise: cuBLASLt's block-wise _scaled_mm cannot take this weight "
                         f"([{n}, {k}], {dtype}, scale blocks {group_n} x {group_k}: it needs 128 x 128 blocks, bf16, "
                         f"K and N multiples of 16 and K / 128 a multiple of 4); use auto, triton or splitk")
    refuse_unavailable(path, _device_index(device))
    return path


class Fp8PathUnavailable(ValueError):
    """engine.fp8_gemm forces a path this device and torch build lack; the message names the key and why."""


def refuse_unavailable(path: str, device_index: int) -> None:
    """engine.fp8_gemm `path` forced on CUDA device `device_index`: raises ValueError, naming the key and the probe's
    reason, where it is "blockwise" and this device and torch build have no block-wise _scaled_mm. The decoders'
    build calls it before the first step (a forced path the device lacks is an error, not a fallback)."""
    if path == "blockwise" and (why_not := blockwise_unsupported_reason(device_index)):
        raise Fp8PathUnavailable(f"engine.fp8_gemm: blockwise: cuBLASLt's block-wise _scaled_mm is unavailable on this "
                         f"device and torch {torch.__version__} ({why_not}); use auto, triton or splitk")


def gemm_path(device: torch.device, dtype: torch.dtype, n: int, k: int, group_n: int, group_k: int | None,
              act_quant: bool, rows: int | None = None) -> str:
    """Which path fp8_linear takes for `rows` (None: any count) activations of `dtype` on `device` times a weight
    [n, k] with these scales: "reference", "rowwise", "splitk", "blockwise" or "triton" (see the module docstring)."""
    if device.type != "cuda" or not act_quant or triton is None:
        return "reference"
    if group_k is None and dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0:
        return "rowwise"
    if group_k is not None and rows is not None and 0 < rows <= SPLITK_MAX_ROWS:
        return "splitk"
    if blockwise_scaled_mm_fits(dtype, n, k, group_n, group_k) and blockwise_scaled_mm_supported(_device_index(device)):
        return "blockwise"
    return "triton"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int | None,
               bias: torch.Tensor | None = None, act_quant: bool = True, scale_ub: float | None = None,
               path: str = "auto") -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K])^T + bias -> [..., N] in x's dtype, by gemm_path's choice. act_quant
    False: a weight-only checkpoint, the reference path everywhere. `path` (engine.fp8_gemm) "blockwise", "triton"
    or "splitk": that path for block-scaled weights on CUDA at every M (others: gemm_path's choice)."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    n, k = weight.shape
    auto = gemm_path(x.device, x.dtype, n, k, group_n, group_k, act_quant, x2.shape[0])
    path = forced_path(path, auto, x.device, x.dtype, n, k, group_n, group_k)
    if path == "reference":
        out = linear_ref(x2, weight, scale, group_n, group_k, bias)
    elif path == "rowwise":
        out = rowwise_scaled_mm(x2, weight, scale.view(1, -1), bias, scale_ub)
    elif path == "blockwise":
        out = blockwise_scaled_mm(x2, weight, scale, bias, scale_ub)
    elif path == "splitk":
        out = splitk_scaled_matmul(x2, weight, scale, group_n, group_k, bias, scale_ub)
    else:
        out = block_scaled_matmul(x2, weight, scale, group_n, group_k, bias, scale_ub)
    return out.reshape(*x.shape[:-1], n)

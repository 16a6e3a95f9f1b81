"""FP8 GEMMs through cuBLASLt's block-wise scaling: torch._scaled_mm with 1x128 activation and 128x128 weight
block scales, fp8_gemm's "blockwise" path (kernels/fp8/gemm.py picks it; README "FP8 checkpoints").

  - where it applies (`blockwise_scaled_mm_fits`): 128x128 block weight scales, bf16 activations, K and N multiples
    of 16 as _scaled_mm needs, and K / 128 a multiple of 4 for cuBLASLt's 128x128 scale layout;
  - where it runs (`blockwise_scaled_mm_supported`: sm90, torch with cuBLASLt >= 12.9): probed once per device by a
    few tiny GEMMs against the W8A8 reference; `blockwise_unsupported_reason` says why not (the error torch raised,
    or the wrong result), for messages and bench reports;
  - the GEMM (`blockwise_scaled_mm`): x quantised once per token and group of 128 columns
    (fp8_quant.quantize_groups: its column-major scales are cuBLAS's 1x128 layout), then torch._scaled_mm with the
    weight's block scales, rows padded to a multiple of 4 (`_blockwise_mm`). Fastest at every layer shape and M
    measured where it runs;
  - engine.fp8_gemm forcing it on a device without it: `refuse_unavailable` raises `Fp8PathUnavailable`, naming
    the key and the probe's reason.

The GEMM is CUDA-graph capturable (no host syncs, output shapes follow x's and the weight's only). The probe runs a
few tiny GEMMs and syncs once per device; it refuses to run inside a capture, and the decoders' build runs it first
(models/registry.build_decode_forward).
"""

from __future__ import annotations

import torch

from batchgen.kernels.fp8.quant import linear_ref, quantize_groups, quantize_groups_ref, quantize_weight


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
                               "kernels.fp8.blockwise.blockwise_scaled_mm_supported(device) before capturing")
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
    return blockwise_matmul(xq, x_scale, weight, scale, x.dtype, bias)


def blockwise_matmul(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The block-wise GEMM over already-quantised activations (quantize_groups' output or layout: xq [M, K] fp8,
    x_scale [M, K / 128] with strides (1, M)) -> [M, N] in out_dtype, the bias added in out_dtype."""
    out = _blockwise_mm(xq, x_scale, weight, scale, out_dtype)
    return out if bias is None else out.add_(bias)


class Fp8PathUnavailable(ValueError):
    """engine.fp8_gemm forces a path this device and torch build lack; the message names the key and why."""


def refuse_unavailable(path: str, device_index: int) -> None:
    """engine.fp8_gemm `path` forced on CUDA device `device_index`: raises ValueError, naming the key and the probe's
    reason, where it is "blockwise" and this device and torch build have no block-wise _scaled_mm. The decoders'
    build calls it before the first step (a forced path the device lacks is an error, not a fallback)."""
    if path == "blockwise" and (why_not := blockwise_unsupported_reason(device_index)):
        raise Fp8PathUnavailable(f"engine.fp8_gemm: blockwise: cuBLASLt's block-wise _scaled_mm is unavailable on this "
                         f"device and torch {torch.__version__} ({why_not}); use auto, triton or splitk")

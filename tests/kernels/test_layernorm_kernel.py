"""The fused residual add + LayerNorm kernel (kernels/norm/layernorm.py) against its torch reference (torch's own add
and layer_norm): under TRITON_INTERPRET=1 on CPU in fp32 and bf16, and on a GPU at Starcoder2-3B's width.

bf16: the kernel's fp32 mean and variance are summed in another order than torch's (Welford on CUDA, row
moments on CPU), so its output may differ from torch's in the last bit: it must lie within one bf16 ulp of it.
The residual is one rounding of the fp32 sum, as torch's add: bitwise torch's on the GPU. Triton 3.6's
interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even, as torch): under it the residual must be
the fp32 sum rounded toward zero, bitwise, and the output is compared with torch's LayerNorm of that residual."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from conftest import run_under_interpreter  # noqa: E402

EPS = 1e-5


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in bf16 ulps: bit patterns put in numeric order (+0 and -0 alike), so a pair of
    opposite signs counts the steps through zero."""
    def ordered(t):
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def _round_toward_zero_bf16(s: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits, as the interpreter rounds (exact afterwards: nothing left to round)."""
    return (s.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def _assert_bf16_close(out, ref, row, weight, bias):
    """Within one bf16 ulp of `ref`, or within a few fp32 roundings of the magnitudes that cancel on the way:
    x and mean (torch's CPU kernel takes x * rstd - mean * rstd), then w * norm(x) and b. Where the output is
    far smaller than those (the bias cancelling the normalised term, x close to a large mean), the two kernels'
    fp32 values differ by more than its bf16 ulp before their one rounding."""
    xf = row.float()
    mean, rstd = xf.mean(-1, keepdim=True), torch.rsqrt(xf.var(-1, unbiased=False, keepdim=True) + EPS)
    terms = weight.float().abs() * (xf.abs() + mean.abs()) * rstd + (0.0 if bias is None else bias.float().abs())
    close = (_bf16_ulps(out, ref) <= 1) | ((out.float() - ref.float()).abs() <= terms * 2.0 ** -21)
    assert close.all(), f"{(~close).sum().item()} elements beyond one bf16 ulp"


def _check_layernorm(device, dtype, num_rows, num_cols, seed=0):
    """The kernel (`use_triton=True`) against the reference, with and without residual and bias; each row alone
    gives the bits it gives in the batch; `out` = a strided column slice of x, in place."""
    from batchgen.kernels.norm.layernorm import layernorm

    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    x = rand(num_rows, num_cols) + rand(num_rows, 1, scale=3.0)  # rows of non-zero mean
    residual, weight, bias = rand(num_rows, num_cols, scale=4.0), 1.0 + rand(num_cols, scale=0.3), rand(num_cols, scale=0.2)
    interpreted = device == "cpu"  # the interpreter rounds bf16 toward zero
    for res in (None, residual):
        for b in (None, bias):
            r_kernel = None if res is None else res.clone()
            r_ref = None if res is None else res.clone()
            out = layernorm(x, weight, b, EPS, residual=r_kernel, use_triton=True)
            ref = layernorm(x, weight, b, EPS, residual=r_ref, use_triton=False)
            row = x if res is None else r_kernel  # the row the kernel normalised
            if res is not None:
                if dtype == torch.bfloat16 and interpreted:
                    assert torch.equal(r_kernel, _round_toward_zero_bf16(x.float() + res.float()))
                    ref = F.layer_norm(r_kernel, (num_cols,), weight, b, EPS)  # torch's norm of the same row
                else:
                    assert torch.equal(r_kernel, r_ref)  # one rounding of the fp32 sum, as torch's add
            assert out.dtype == dtype and out.shape == x.shape
            if dtype == torch.float32:
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            else:
                _assert_bf16_close(out, ref, row, weight, b)
            # batch invariance: one program per row, the row's sums in an order set by the row length alone
            for i in (0, num_rows - 1):
                r_one = None if res is None else res[i:i + 1].clone()
                assert torch.equal(layernorm(x[i:i + 1], weight, b, EPS, residual=r_one, use_triton=True), out[i:i + 1])
    # without residual, in place over a strided column slice (each program reads its row before it writes it)
    wide = rand(num_rows, num_cols + 5)
    view = wide[:, 2:2 + num_cols]
    expected = layernorm(view.clone(), weight, bias, EPS, use_triton=True)
    assert layernorm(view, weight, bias, EPS, use_triton=True, out=view) is view
    assert torch.equal(view, expected)


INTERPRET_SCRIPT = """
import torch, sys
sys.path[:0] = ["tests", "tests/kernels"]
from test_layernorm_kernel import _check_layernorm
for dtype in (torch.float32, torch.bfloat16):
    _check_layernorm("cpu", dtype, num_rows=5, num_cols=96)  # BLOCK 128: masked columns
    _check_layernorm("cpu", dtype, num_rows=4, num_cols=3072, seed=1)  # Starcoder2-3B's width, BLOCK 4096
    _check_layernorm("cpu", dtype, num_rows=3, num_cols=128, seed=2)  # a power of two: no masked column
print("ok")
"""


def test_layernorm_kernel_matches_torch_under_triton_interpreter():
    run_under_interpreter(INTERPRET_SCRIPT)


def test_reference_is_the_eager_add_then_layer_norm_bit_for_bit():
    """use_triton=False is what blocks.add_norm ran before the kernel: `residual.add_(x)`, then F.layer_norm."""
    from batchgen.kernels.norm.layernorm import layernorm

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x, res = (torch.randn(6, 96, generator=g).to(dtype) for _ in "xr")
        ln = torch.nn.LayerNorm(96, eps=EPS, dtype=dtype)
        torch.nn.init.normal_(ln.weight, 1.0, 0.3, generator=g)
        torch.nn.init.normal_(ln.bias, 0.0, 0.2, generator=g)
        with torch.no_grad():
            expected_res = res + x
            expected = ln(expected_res)
            r = res.clone()
            assert torch.equal(layernorm(x, ln.weight, ln.bias, EPS, residual=r, use_triton=False), expected)
            assert torch.equal(r, expected_res)
            out = torch.empty_like(x)
            assert layernorm(x, ln.weight, None, EPS, use_triton=False, out=out) is out
            assert torch.equal(out, F.layer_norm(x, (96,), ln.weight, None, EPS))


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [32, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layernorm_kernel_matches_torch_on_gpu_at_starcoder2_3b_width(num_rows, dtype):
    _check_layernorm("cuda", dtype, num_rows=num_rows, num_cols=3072)

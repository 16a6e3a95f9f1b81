"""bench/pdl_chain.py (the PDL micro-benchmark) on CPU: every kernel variant compiles for sm_90 with the grid
dependency instructions exactly where intended (its --check-compile mode: ~25 s on 2 cores with an empty Triton
cache), and the plain kernels compute the chain's math (Triton's interpreter against a torch reference).

Triton 3.6's interpreter converts fp32 -> fp8 e4m3 with other rounding than the GPU's round-to-nearest-even (ties
away from zero; a value that rounds up to the next power of two comes out halved: -124.97 -> -64), and fp32 ->
bf16 toward zero. So the fp8 activations are compared loosely, and the GEMM + reduce are checked against a reference
over the kernels' own fp8 activations and scales, to one bf16 rounding."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

INTERPRET_SCRIPT = r"""
import sys
import torch
sys.path.insert(0, "bench")
import pdl_chain

torch.manual_seed(0)
# K 2048 (16 blocks of 128): 2 splits and the reduce kernel; K 256: one split, the GEMM stores bf16 itself
for n, k in ((256, 2048), (384, 256)):
    chain = pdl_chain.Chain(1, 32, "cpu", 132, shapes={"p": (n, k)})
    assert chain.splits["p"][1] == (2 if k == 2048 else 1), chain.splits
    out = chain.run("plain").float()
    w, ws, nw = chain.layers[0]["p"]
    x = chain.x_in.float()
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()).view(32, k // 128, 128)
    scale = y.abs().amax(-1).clamp_min(1e-10) / 448.0
    assert torch.allclose(chain.s[k], scale, rtol=1e-5, atol=0), "activation scales"
    q = (y / scale[..., None]).to(torch.float8_e4m3fn).view(32, k).float()
    assert (chain.q[k].float() != q).float().mean() < 0.05, "fp8 activations (interpreter rounding aside)"
    a = chain.q[k].float().view(32, k // 128, 128) * chain.s[k][..., None]
    ref = a.view(32, k) @ (w.float() * ws.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)).T
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err
print("ok")
"""


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_pdl_chain_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile mode: real JITFunctions
    result = _run(["bench/pdl_chain.py", "--check-compile"], env)
    assert result.returncode == 0 and "compiled for sm_90: ok" in result.stdout, result.stdout + result.stderr[-3000:]


def test_pdl_chain_plain_kernels_interpreted():
    result = _run(["-c", INTERPRET_SCRIPT], {**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr[-3000:]

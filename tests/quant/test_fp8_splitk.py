"""The split-K FP8 GEMM (kernels/fp8/splitk.py): against the emulated W8A8 reference under TRITON_INTERPRET=1 on CPU
(exact-grid activations, as tests/quant/test_fp8_kernels.py explains) and on a GPU at the Llama-3.1-8B layer shapes,
eager and replayed from CUDA graphs; its launch configs; and that fp8_gemm.gemm_path takes it only where SPLITK_MAX_ROWS
and, per weight shape, SPLITK_SHAPE_ROWS say (with the sweep that writes that table).

Triton 3.6's interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even): under it the bf16 output
is checked to one bf16 ulp of the fp32 output; on the GPU it must equal the fp32 output rounded (one rounding)."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from conftest import needs_interpreter, run_under_interpreter  # noqa: E402

from batchgen.kernels.fp8 import blockwise as fp8_blockwise  # noqa: E402

from batchgen.kernels.fp8 import gemm as fp8_gemm
from batchgen.kernels.fp8.gemm import fp8_linear, gemm_path, w8a8_matmul  # noqa: E402
from batchgen.kernels.fp8.quant import linear_ref, quantize_groups, quantize_weight  # noqa: E402
from batchgen.kernels.fp8.splitk import split_sizes, splitk_config, splitk_matmul, splitk_scaled_matmul  # noqa: E402
from batchgen.kernels.fp8.splitk_common import sm_balance  # noqa: E402

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}

INTERPRET_SCRIPT = r"""
import torch
from batchgen.kernels.fp8.quant import linear_ref, quantize_groups, quantize_weight
from batchgen.kernels.fp8.splitk import SplitKConfig, splitk_matmul, splitk_scaled_matmul

torch.manual_seed(0)

import sys
sys.path.insert(0, "tests")
from fp8_checkpoints import exact_activations as exact_x

# K 576: 5 scale blocks, the last partial; N 200: no multiple of BLOCK_N. Splits 3 -> 2+2+1 blocks (reduction
# kernel), 2 -> 3+2, 1 -> the GEMM kernel's own epilogue. Then 32x32 blocks with per-row scales (group_n 1), and
# per-channel scales.
cases = [(5, 200, 576, 128, 128, cfg) for cfg in (SplitKConfig(32, 3, 4, 1), SplitKConfig(64, 2, 4, 1))]
cases += [(1, 200, 576, 128, 128, SplitKConfig(64, 3, 4, 1)), (1, 200, 576, 128, 128, SplitKConfig(32, 1, 4, 1))]
cases += [(5, 72, 160, 1, 32, SplitKConfig(32, 5, 4, 1)), (3, 48, 384, 1, None, SplitKConfig(32, 3, 4, 1))]
# weight tiles through a TMA descriptor: zero-filled past N (200) and K (576) instead of wrapped / masked
cases += [(5, 200, 576, 128, 128, SplitKConfig(64, 3, 4, 1, True)),
          (1, 200, 576, 128, 128, SplitKConfig(32, 1, 4, 1, True)),
          (3, 48, 384, 1, None, SplitKConfig(32, 3, 4, 1, True))]
# several row tiles (the grid's fastest axis), the last partial: 40 rows in tiles of 16 and of 32
cases += [(40, 200, 576, 128, 128, SplitKConfig(32, 3, 4, 1, False, 16)),
          (40, 200, 576, 128, 128, SplitKConfig(64, 1, 4, 1, True, 32)),
          (130, 200, 576, 128, 128, SplitKConfig(64, 2, 4, 1, False, 128))]  # the sweep's 128-row tiles
for m, n, k, gn, gk, cfg in cases:
    x = exact_x(m, k, gk or 128)
    w, s = quantize_weight(torch.randn(n, k) * 0.05, gn if gk else None, gk)
    bias = torch.randn(n)
    ref = linear_ref(x, w, s, gn, gk, bias, act_group=gk or 128)
    xq, xs = quantize_groups(x, gk or 128)
    out = splitk_matmul(xq, xs, w, s, gn, gk, torch.float32, bias, cfg)
    assert (out - ref).abs().max().item() < 1e-5 * ref.abs().max().item(), (m, n, k, gn, gk, cfg)
    out16 = splitk_matmul(xq, xs, w, s, gn, gk, torch.bfloat16, bias, cfg)
    assert ((out16.float() - out).abs() <= out.abs() * 2.0 ** -7).all(), (m, n, k, cfg)
out = splitk_scaled_matmul(x, w, s, gn, gk, bias, config=SplitKConfig(32, 2, 4, 1))  # the quantiser in front
assert (out - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
print("ok")
"""


@needs_interpreter
def test_splitk_gemm_matches_the_w8a8_reference_under_triton_interpreter():
    run_under_interpreter(INTERPRET_SCRIPT, timeout=300)


def test_splitk_default_configs_fill_the_gpu_evenly_with_even_splits_of_at_least_eight_scale_blocks():
    # 384, 256, 224, 512 programs at M <= 64 on 132 SMs; o: 8 splits would give 2 a SM but 4 blocks a split;
    # down: 7 splits (448 programs: 3 or 4 an SM) spread less evenly than 8 (512: 3 or 4, mostly 4)
    want = {"qkv": (64, 4), "o": (64, 4), "gate_up": (128, 1), "down": (64, 8)}
    for name, (n, k) in SHAPES_8B.items():
        for m in (1, 32, 64):
            cfg = splitk_config(m, n, k, 128, 132)
            assert (cfg.block_n, cfg.splits) == want[name] and (k // 128) % cfg.splits == 0, (name, m, cfg)
            assert (k // 128) // cfg.splits >= 8 and cfg.stages == 4
            assert -(-n // cfg.block_n) * cfg.splits >= {"o": 256, "gate_up": 132}.get(name, 2 * 132)
    assert sm_balance(448, 132) < sm_balance(512, 132) < 1 == sm_balance(264, 132)
    # Qwen2-7B: down's 148 blocks (4 x 37) split unevenly in 5; o's 28 blocks in at most 3 (uneven: 10, 10, 8)
    assert splitk_config(32, 3584, 18944, 128, 132).splits == 5
    assert splitk_config(32, 3584, 3584, 128, 132).splits == 3 and split_sizes(28, 3) == (10, 3)
    assert split_sizes(5, 3) == (2, 3) and split_sizes(5, 4) == (2, 3) and split_sizes(4, 9) == (1, 4)


CUDA0 = torch.device("cuda", 0)  # gemm_path reads the device's type and index only: no GPU needed


def test_gemm_path_takes_splitk_only_up_to_splitk_max_rows(monkeypatch):
    monkeypatch.setattr(fp8_blockwise, "blockwise_scaled_mm_supported", lambda index: True)
    monkeypatch.setattr(fp8_gemm, "SPLITK_SHAPE_ROWS", {})  # no shape measured past SPLITK_MAX_ROWS
    bf16 = torch.bfloat16
    assert fp8_gemm.SPLITK_MAX_ROWS == 32  # the decode rows at which the H200 measured it fastest (W1)
    assert gemm_path(CUDA0, bf16, 4096, 4096, 128, 128, True, 1) == "splitk"
    assert gemm_path(CUDA0, bf16, 4096, 4096, 128, 128, True, 33) == "blockwise"
    monkeypatch.setattr(fp8_blockwise, "blockwise_scaled_mm_supported", lambda index: False)
    assert gemm_path(CUDA0, bf16, 4096, 4096, 128, 128, True, 32) == "splitk"
    assert gemm_path(CUDA0, bf16, 4096, 4096, 128, 128, True, 33) == "triton"
    monkeypatch.setattr(fp8_blockwise, "blockwise_scaled_mm_supported", lambda index: True)
    monkeypatch.setattr(fp8_gemm, "SPLITK_MAX_ROWS", 64)
    for rows in (1, 32, 64):
        assert gemm_path(CUDA0, bf16, 4096, 4096, 128, 128, True, rows) == "splitk"
        assert gemm_path(CUDA0, torch.float16, 4096, 4096, 1, 32, True, rows) == "splitk"
        assert gemm_path(CUDA0, bf16, 4096, 4096, 1, None, True, rows) == "rowwise"  # per channel: as before
        assert gemm_path(torch.device("cpu"), bf16, 4096, 4096, 128, 128, True, rows) == "reference"
    assert gemm_path(CUDA0, bf16, 4096, 4096, 128, 128, True, 65) == "blockwise"
    assert gemm_path(CUDA0, bf16, 4096, 4096, 128, 128, True) == "blockwise"  # row count unknown


def test_gemm_path_takes_splitk_up_to_a_shapes_measured_rows(monkeypatch):
    """fp8_gemm.SPLITK_SHAPE_ROWS (bench/fp8_gemm.py --sweep's literal) routes one weight shape to split-K above
    SPLITK_MAX_ROWS; other shapes keep the block-wise _scaled_mm."""
    monkeypatch.setattr(fp8_blockwise, "blockwise_scaled_mm_supported", lambda index: True)
    monkeypatch.setattr(fp8_gemm, "SPLITK_SHAPE_ROWS", {(4096, 14336): 256})
    bf16 = torch.bfloat16
    for rows in (1, 32, 33, 256):
        assert gemm_path(CUDA0, bf16, 4096, 14336, 128, 128, True, rows) == "splitk", rows
    assert gemm_path(CUDA0, bf16, 4096, 14336, 128, 128, True, 257) == "blockwise"
    assert gemm_path(CUDA0, bf16, 14336, 4096, 128, 128, True, 256) == "blockwise"  # (N, K), not (K, N)
    assert gemm_path(CUDA0, bf16, 4096, 14336, 1, None, True, 64) == "rowwise"  # per channel: never split-K
    assert "4096x14336 to 256" in fp8_gemm.describe_paths(CUDA0, bf16, 128, 128, True)


def test_the_fp8_gemm_sweep_routes_a_shape_to_splitk_only_up_to_its_first_loss():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import fp8_gemm as sweep

    def row(n, m, splitk, cublas):
        return {"N": n, "K": 4096, "M": m, "splitk_default_ms": splitk, "cublas_alone_ms": cublas}

    sweeps = [row(4096, 32, 0.01, 0.02), row(4096, 128, 0.01, 0.02), row(4096, 256, 0.015, 0.02),
              row(4096, 512, 0.03, 0.02), row(6144, 256, 0.03, 0.02), row(6144, 512, 0.01, 0.02),
              row(28672, 256, float("nan"), 0.05)]
    assert sweep.splitk_shape_rows(sweeps, [32, 128, 256, 512], 32) == {(4096, 4096): 256}  # 6144: lost at 256
    # a swept M without figures (its configs failed) ends a shape's run of wins: 128 unmeasured, nothing routed
    assert sweep.splitk_shape_rows(sweeps, [64, 128, 256], 32) == {}
    configs = sweep.splitk_sweep_configs(256, 4096, 14336)
    assert {c.block_m for c in configs} == {64, 128} and all(c.splits <= 16 for c in configs)
    assert all(c.block_m == 0 for c in sweep.splitk_sweep_configs(32, 4096, 14336))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES_8B))
def test_splitk_gemm_at_the_8b_shapes_equals_the_reference_and_replays_from_a_cuda_graph(monkeypatch, name):
    n, k = SHAPES_8B[name]
    g = torch.Generator("cuda").manual_seed(0)
    w, s = quantize_weight(torch.randn(n, k, device="cuda", generator=g) * 0.02, 128, 128)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    monkeypatch.setattr(fp8_gemm, "SPLITK_MAX_ROWS", 256)  # fp8_linear takes the split-K path
    for m in (1, 32, 64, 256):  # 256: four row tiles of 64
        x = (torch.randn(m, k, device="cuda", generator=g) * 2).to(torch.bfloat16)
        out = splitk_scaled_matmul(x, w, s, 128, 128, bias)
        assert _rel_err(out, linear_ref(x, w, s, 128, 128, bias, act_group=128)) < 1e-2, (name, m)
        xq, xs = quantize_groups(x, 128)
        out32 = splitk_matmul(xq, xs, w, s, 128, 128, torch.float32, bias)
        assert torch.equal(out, out32.to(torch.bfloat16)), (name, m)  # the epilogue rounds once
        # Hopper's FP8 MMA adds its products in fewer bits than fp32 within each 128-wide K group (measured on the
        # H200: 1.8e-4 at qkv, M = 64), so the fp32 sums agree with the reference to ~1e-4, not to fp32 rounding
        assert _rel_err(out32, w8a8_matmul(xq, xs, w, s, 128, 128, torch.float32, bias)) < 1e-3, (name, m)
        assert torch.equal(fp8_linear(x, w, s, 128, 128, bias), out), (name, m)  # the entry point; deterministic
        static_x = x.clone()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fp8_linear(static_x, w, s, 128, 128, bias)
        static_x.copy_(x * 3)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, splitk_scaled_matmul(x * 3, w, s, 128, 128, bias)), (name, m)

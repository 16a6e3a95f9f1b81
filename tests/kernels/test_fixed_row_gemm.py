"""engine.deterministic's fixed-row cuBLAS GEMM (kernels/invariant/fixed_row_gemm.py) and its self-check and per-weight
choice (kernels/invariant/linear.py): on CPU the padding and chunking with stand-in GEMMs, and the self-check
catching each kind of row dependence; on a GPU, bitwise invariance at the 8B model's shapes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels.invariant.fixed_row_gemm import ALIGN_BYTES, FIXED_ROWS, cublas_fixed_rows, fixed_row_linear
from batchgen.kernels.invariant.linear import FIXED, TRITON, InvariantLinear, row_dependence, same_bits
from batchgen.kernels.invariant.matmul import linear_rows


def _integer_valued(g, *shape):
    """fp32 with small integer values: every summation order gives the exact result, so a GEMM on any M (MKL
    rounds M = 1 and M = 3 differently otherwise) must equal F.linear bitwise."""
    return torch.randint(-4, 5, shape, generator=g).float()


class RecordingGemm:
    """F.linear that keeps a copy of every A operand it is called with (and its address)."""

    def __init__(self):
        self.operands = []

    def __call__(self, x, weight, bias):
        self.operands.append((x.clone(), x.data_ptr(), x.is_contiguous()))
        return F.linear(x, weight, bias)


@pytest.mark.parametrize("num_rows", [1, 3, 255, 256, 257, 600])
def test_fixed_row_linear_equals_f_linear_at_any_m_calling_the_gemm_on_256_rows_zero_padded(num_rows):
    g = torch.Generator().manual_seed(num_rows)
    w, b = _integer_valued(g, 96, 64), _integer_valued(g, 96)
    wide = _integer_valued(g, num_rows, 80)
    layouts = {"contiguous": _integer_valued(g, num_rows, 64),
               "column-major": _integer_valued(g, 64, num_rows).t(),  # strides (1, M)
               "row-strided": wide[:, 3:67]}  # a view: row stride 80, address not aligned
    for name, x in layouts.items():
        for bias in (b, None):
            gemm = RecordingGemm()
            y = fixed_row_linear(x, w, bias, gemm=gemm)
            assert same_bits(y, F.linear(x, w, bias)), (name, bias is None)
            assert len(gemm.operands) == -(-num_rows // FIXED_ROWS)
            for i, (operand, _, contiguous) in enumerate(gemm.operands):
                rows_here = min(FIXED_ROWS, num_rows - i * FIXED_ROWS)
                assert operand.shape == (FIXED_ROWS, 64) and contiguous
                assert same_bits(operand[:rows_here], x[i * FIXED_ROWS:i * FIXED_ROWS + rows_here].contiguous())
                assert not operand[rows_here:].any(), "padding rows are zeros"


def _aligned_rows(num_rows, depth, misalign_bytes=0):
    """A contiguous fp32 [num_rows, depth] view whose address is ALIGN_BYTES-aligned plus `misalign_bytes`."""
    store = torch.zeros(num_rows * depth + 2 * ALIGN_BYTES)
    skip = (-store.data_ptr() % ALIGN_BYTES + misalign_bytes) // 4
    return store[skip:skip + num_rows * depth].view(num_rows, depth)


def test_a_256_row_aligned_x_is_the_gemms_operand_itself_and_a_misaligned_one_is_copied_first():
    g = torch.Generator().manual_seed(0)
    w = _integer_valued(g, 32, 16)
    for num_rows in (256, 512):  # one call, or two full chunks: views of x where x is aligned, copies if not
        for misalign in (0, 4):
            x = _aligned_rows(num_rows, 16, misalign)
            x.copy_(_integer_valued(g, num_rows, 16))
            gemm = RecordingGemm()
            assert same_bits(fixed_row_linear(x, w, None, gemm=gemm), F.linear(x, w))
            addresses = [address for _, address, _ in gemm.operands]
            in_place = [x.data_ptr() + i * FIXED_ROWS * 16 * 4 for i in range(num_rows // FIXED_ROWS)]
            assert (addresses == in_place) == (misalign == 0), (num_rows, misalign)


def _row_dependent(kind):
    """A fixed-row linear with one kind of row dependence, each one the self-check's (a), (b) or (c) catches: a
    256-row GEMM adding row 0's output to every row; one changing its rows when it holds a zero row (padding);
    rows changed when M exceeds 256 (a chunking that depends on M)."""
    def gemm(operand, w, b):
        y = linear_rows(operand, w, b)
        if kind == "position":
            return y + y[:1]
        return y + 1.0 if kind == "padding" and (operand == 0).all(dim=1).any() else y

    def linear(x, w, b):
        y = fixed_row_linear(x, w, b, gemm=gemm)
        return y + 1.0 if kind == "long" and x.shape[0] > FIXED_ROWS else y
    return linear


@pytest.mark.parametrize("kind, says", [("position", "position"), ("padding", "alone"), ("long", "512-row")])
def test_the_self_check_catches_each_kind_of_row_dependence(kind, says):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    good = lambda x, w, b: fixed_row_linear(x, w, b, gemm=linear_rows)  # noqa: E731
    assert row_dependence(good, w, b) is None
    assert says in row_dependence(_row_dependent(kind), w, b)


def test_a_weight_failing_the_self_check_runs_the_triton_gemm_with_one_warning_naming_its_shape():
    """The stand-in is row-dependent for the 96x64 weight only: that weight is sent to the Triton GEMM, warned
    about once; the 40x64 weight with a bias keeps the fixed-row GEMM, silently."""
    bad_n = 96

    def fixed_rows(x, w, b):
        return _row_dependent("position")(x, w, b) if w.shape[0] == bad_n else fixed_row_linear(x, w, b, linear_rows)

    g = torch.Generator().manual_seed(2)
    bad, good = torch.randn(bad_n, 64, generator=g), torch.randn(40, 64, generator=g)
    bias = torch.randn(40, generator=g)
    linear = InvariantLinear(fixed_rows)
    with pytest.warns(UserWarning, match=r"96x64 float32 weight is not row-independent") as caught:
        assert linear.path(bad, None) == TRITON
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert linear.path(good, bias) == FIXED
        assert linear.path(bad, None) == TRITON  # decided once
    assert sorted(linear.paths.values()) == [FIXED, TRITON]
    assert {name.split(" @")[0]: path for name, path in linear.summary().items()} == {
        "96x64 float32": TRITON, "40x64 float32 + bias": FIXED}
    x = torch.randn(5, 64, generator=g)
    assert same_bits(linear(x, good, bias), linear_rows(x, good, bias))  # CPU: the per-row path, as before


# the 8B model's GEMMs: fused q/k/v, o_proj, fused gate/up, down_proj, the LM head ([N, K] weights)
LLAMA_8B_GEMMS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", LLAMA_8B_GEMMS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_fixed_row_cublaslt_rows_are_bitwise_the_same_at_m_1_16_256_and_300_bf16(shape):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16) * 0.02
    x = torch.randn(300, shape[1], generator=g, device="cuda").to(torch.bfloat16)
    assert row_dependence(cublas_fixed_rows, w, None) is None  # the self-check keeps this weight on cuBLAS
    full = cublas_fixed_rows(x[:256], w)  # [256, N]: M = 256, one call on x itself
    long = cublas_fixed_rows(x, w)  # M = 300: a 256-row chunk, then 44 rows padded
    assert same_bits(long[:256], full)
    for i in (0, 7, 15, 200, 255, 256, 299):
        alone = cublas_fixed_rows(x[i:i + 1], w)[0]
        assert same_bits(alone, full[i] if i < 256 else long[i]), i
        if i < 256:
            lo = i - i % 16
            assert same_bits(cublas_fixed_rows(x[lo:lo + 16], w)[i - lo], full[i]), i
    torch.testing.assert_close(long.float(), F.linear(x, w).float(), atol=0.05, rtol=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 14336), (128256, 4096)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_fixed_row_rows_are_the_same_eagerly_on_a_side_stream_and_replayed_from_a_cuda_graph_bf16(shape):
    """The engine checks on the default stream, prefills on its compute stream and decodes from graphs captured
    on a third: cuBLAS must pick the same kernel on each (torch gives every stream its own workspace)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16) * 0.02
    x = torch.randn(32, shape[1], generator=g, device="cuda").to(torch.bfloat16)
    eager = cublas_fixed_rows(x, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        side = cublas_fixed_rows(x, w)  # also the warm-up of this stream's cuBLAS handle, before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = cublas_fixed_rows(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(side, eager) and same_bits(captured, eager)


@pytest.mark.gpu
def test_gpu_invariant_linear_runs_the_triton_gemm_for_a_weight_failing_the_check_and_cublas_for_the_others():
    from batchgen.kernels.invariant.matmul import matmul_invariant

    g = torch.Generator(device="cuda").manual_seed(2)
    bad = torch.randn(4096, 4096, generator=g, device="cuda").to(torch.bfloat16) * 0.02
    good = torch.randn(6144, 4096, generator=g, device="cuda").to(torch.bfloat16) * 0.02
    x = torch.randn(40, 4096, generator=g, device="cuda").to(torch.bfloat16)

    def fixed_rows(x, w, b):
        y = cublas_fixed_rows(x, w, b)
        return y + y[:1] if w.shape[0] == 4096 else y

    linear = InvariantLinear(fixed_rows)
    with pytest.warns(UserWarning, match="4096x4096 bfloat16"):
        assert same_bits(linear(x, bad), matmul_invariant(x, bad))
    assert same_bits(linear(x, good), cublas_fixed_rows(x, good))


@pytest.mark.gpu
def test_gpu_a_weights_first_call_inside_a_graph_capture_raises_instead_of_checking():
    w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    linear = InvariantLinear()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            linear(x, w)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_a_deterministic_engine_checks_every_weight_before_capture_and_keeps_them_on_fixed_row_cublaslt():
    """The build's first step ran the self-check for each of the tiny Llama's five weight shapes (q/k/v, o,
    gate/up, down, LM head) before the graphs were captured, and each passed on this GPU."""
    from conftest import make_model

    from batchgen import Engine
    from batchgen.engine.config import EngineConfig

    model = make_model("llama", vocab_size=512).to("cuda", torch.bfloat16)
    cfg = EngineConfig(deterministic=True, max_num_seqs=8, num_kv_blocks=64, block_size=16)
    with Engine(model, None, cfg) as engine:
        assert engine.runner.graphs is not None
        summary = engine.runner.decode_forward.linear.summary()
    assert {name.split(" @")[0] for name in summary} == {
        "128x64 bfloat16", "64x64 bfloat16", "256x64 bfloat16", "64x128 bfloat16", "512x64 bfloat16"}
    assert set(summary.values()) == {FIXED}, summary


def test_the_pinned_library_is_the_engine_configs_default_graph_library():
    """engine.config refuses other graph_blas_library values in deterministic mode by naming its default: the
    library the fixed-row GEMM pins must be that default."""
    from batchgen.engine.config import EngineConfig
    from batchgen.kernels.invariant.fixed_row_gemm import BLAS_LIBRARY

    assert EngineConfig.model_fields["graph_blas_library"].default == BLAS_LIBRARY

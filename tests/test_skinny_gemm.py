"""The split-K skinny GEMM (kernels/skinny_gemm.py): against F.linear in fp32 under TRITON_INTERPRET=1 on CPU (odd N
and K, with and without bias, several split counts, one split), its default configs, the engine's opt-in
(engine.decode_gemm: triton_splitk -> the fused decoder's `linear`; refused with engine.deterministic), and on a GPU
in bf16 at an 8B shape, eager and replayed from a CUDA graph.

Triton 3.6's interpreter rounds fp32 -> bf16 toward zero: hence the interpreter checks run in fp32."""

from __future__ import annotations

import numpy
import pytest
import torch
import torch.nn.functional as F

from batchgen.engine.config import EngineConfig
from batchgen.kernels.skinny_gemm import skinny_config, skinny_linear
from batchgen.kernels.splitk_common import split_count, split_sizes
from batchgen.models import fp8

NUMPY_TOO_NEW = tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4)

INTERPRET_SCRIPT = r"""
import torch
import torch.nn.functional as F
from batchgen.kernels.skinny_gemm import SkinnyConfig, skinny_linear

torch.manual_seed(0)
# N 100: no multiple of BLOCK_N; K 200: 2 blocks of 128 (the second partial), 4 of 64 (the last partial), 7 of 32.
# Splits 1 (the GEMM's own epilogue), 2, 3 (-> 7 blocks as 3+3+1), 4 (4 of 64, one block each).
configs = [SkinnyConfig(64, 128, 1, 4, 1), SkinnyConfig(64, 128, 2, 4, 1), SkinnyConfig(32, 32, 3, 4, 1),
           SkinnyConfig(32, 64, 4, 4, 1)]
for m in (1, 5, 32, 64):
    x = torch.randn(m, 200)
    w = torch.randn(100, 200) * 0.05
    b = torch.randn(100)
    for cfg in configs:
        for bias in (None, b):
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()
            out = skinny_linear(x, w, bias, cfg, use_triton=True)
            assert out.dtype == torch.float32 and out.shape == (m, 100)
            err = (out - ref).abs().max().item()
            assert err < 1e-5 * ref.abs().max().item(), (m, cfg, bias is None, err)
# the default config (splits from the shared rule) and a strided x (a column slice)
x = torch.randn(32, 300)[:, :200]
out = skinny_linear(x, w, b, use_triton=True)
assert (out - F.linear(x, w, b)).abs().max().item() < 1e-4
print("ok")
"""


@pytest.mark.skipif(NUMPY_TOO_NEW, reason=f"numpy {numpy.__version__} >= 2.4: Triton 3.6's interpreter needs "
                    "numpy < 2.4")
def test_skinny_linear_matches_f_linear_in_fp32_under_triton_interpreter():
    pytest.importorskip("triton")
    from conftest import run_under_interpreter

    run_under_interpreter(INTERPRET_SCRIPT, timeout=600)


def test_skinny_default_configs_fill_the_gpu_with_few_splits():
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "phi3_qkv": (9216, 3072), "qwen2_o": (3584, 3584), "qwen2_down": (3584, 18944)}
    for name, (n, k) in shapes.items():
        for m in (1, 16, 32, 64):
            cfg = skinny_config(m, n, k, 2, 132)
            blocks, tiles = -(-k // cfg.block_k), -(-n // cfg.block_n)
            assert split_sizes(blocks, cfg.splits)[1] == cfg.splits, (name, m, cfg)  # none empty
            assert tiles * cfg.splits >= 2 * 132 and (cfg.splits == 1 or tiles * (cfg.splits - 1) < 2 * 132 or
                                                      blocks % cfg.splits == 0), (name, m, cfg)
            assert cfg.block_n in (64, 128) and cfg.block_k in (128, 256) and cfg.warps == 4 and cfg.stages >= 4
    assert skinny_config(32, 28672, 4096).splits == 1  # gate_up: the column tiles alone fill the GPU
    # Qwen2-7B's down: 148 blocks of 128 = 4 x 37; 5 uneven splits (30 + 30 + 30 + 30 + 28), not 37 even ones
    assert skinny_config(32, 3584, 18944).splits == 5 and split_count(32, 3584, 148, 64, 132) == 5
    assert split_count(32, 4096, 112, 64, 132) == 7  # the 8B down: 7 even splits (5 would do; 7 <= 2 x 5)


def test_skinny_linear_cpu_reference_and_row_limit():
    x, w, b = torch.randn(3, 40), torch.randn(24, 40), torch.randn(24)
    assert torch.equal(skinny_linear(x, w, b, use_triton=False), F.linear(x, w, b))
    with pytest.raises(AssertionError):
        skinny_linear(torch.randn(65, 40), w)


def test_plain_gemm_on_cpu_is_f_linear_and_default_path_unchanged():
    x, w, b = torch.randn(4, 40, dtype=torch.bfloat16), torch.randn(24, 40, dtype=torch.bfloat16), None
    for gemm in ("blas", "triton_splitk"):
        assert torch.equal(fp8.linear(x, w, b, plain_gemm=gemm), F.linear(x, w, b))
    assert fp8.use_skinny(x, w, "blas") is False and fp8.use_skinny(x, w, "triton_splitk") is False  # CPU
    with pytest.raises(ValueError, match="decode_gemm"):
        fp8.linear(x, w, b, plain_gemm="cublas")


def test_engine_config_decode_gemm_default_and_deterministic_refusal():
    assert EngineConfig().decode_gemm == "blas"
    assert EngineConfig(decode_gemm="triton_splitk").decode_gemm == "triton_splitk"
    with pytest.raises(ValueError, match="engine.decode_gemm.*|engine.deterministic"):
        EngineConfig(deterministic=True, decode_gemm="triton_splitk")
    with pytest.raises(ValueError) as err:
        EngineConfig(deterministic=True, decode_gemm="triton_splitk")
    assert "engine.deterministic" in str(err.value) and "engine.decode_gemm" in str(err.value)
    EngineConfig(deterministic=True, decode_gemm="blas")


@pytest.mark.parametrize("arch", ["llama", "phi3", "starcoder2"])
def test_engine_decode_gemm_reaches_the_fused_decoders_linear_and_generates_as_before(arch):
    from batchgen import Engine, SamplingParams
    from conftest import make_model, random_prompts

    model = make_model(arch)
    prompts = random_prompts((5, 9))
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    base = Engine(model, None, EngineConfig(num_kv_blocks=32, block_size=16))
    assert base.runner.decode_forward.linear is fp8.linear  # the default path: the plain function, as before
    expected = [r.samples[0].token_ids for r in base.generate(prompts, params)]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=32, block_size=16, decode_gemm="triton_splitk"))
    fused = engine.runner.decode_forward
    assert fused.is_fused and fused.linear.func is fp8.linear
    assert fused.linear.keywords == {"plain_gemm": "triton_splitk"}
    # CPU: the Triton path is CUDA-only, so the same F.linear and the same tokens
    assert [r.samples[0].token_ids for r in engine.generate(prompts, params)] == expected


@pytest.mark.gpu
def test_skinny_linear_bf16_8b_qkv_shape_eager_and_graphed():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(6144, device="cuda", dtype=torch.bfloat16, generator=g)
    ref32 = F.linear(x.float(), w.float(), b.float())
    out = skinny_linear(x, w, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref32, atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=2e-2, rtol=1.6e-2)
    assert torch.equal(skinny_linear(x, w, b), out)  # deterministic: no atomics
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        graphed = skinny_linear(x, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16, generator=g))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, skinny_linear(x, w, b))

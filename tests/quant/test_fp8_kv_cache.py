"""engine.kv_cache_dtype: fp8 — keys and values stored as float8_e4m3fn (scale 1, saturating at +-448), read
back upcast by every attention path: the Triton decode, several-heads, prefill and rotary kernels (under the
interpreter, each launch also compiled for sm_90) and the torch reference the CPU engine runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.attention.kv_cache import KVGeometry, plan_num_blocks
from batchgen.kernels.attention import reference as paged_attention_ref
from batchgen.kernels.attention.reference import FP8_MAX, KV_FP8, as_cached, write_kv
from conftest import make_model, random_prompts, run_under_interpreter

FP8_KV_INTERPRET_SCRIPT = """
import torch, sys
sys.path[:0] = ["tests", "tests/kernels"]
from test_kernels import _check, _check_prefill, _check_rope_attention, fp8_carry_dropped
from batchgen.kernels.attention.reference import KV_FP8, as_cached
from batchgen.kernels.attention.paged_decode import DecodeLaunch
from batchgen.kernels.attention.rope_kv import rope_kv, rope_kv_ref
fp8 = dict(kv_dtype=KV_FP8)
# decode with the rotary and the K/V write fused (attending to what it wrote, fp32-exact): one split, several
# (the merge), CUDA-core rows, GQA and MHA
for launch in (DecodeLaunch(1, 16, 2), DecodeLaunch(2, 16, 2), DecodeLaunch(2, 16, 2, mma=False),
               DecodeLaunch(1, 16, 2, 2, heads_first=True)):  # the last: the large-batch launch's grid and warps
    _check_rope_attention("cpu", torch.float32, 1e-5, [1, 37, 0, 70, 16], launch=launch, **fp8)
_check_rope_attention("cpu", torch.float32, 1e-5, [1, 37, 0, 70], num_heads=4, num_kv_heads=4, head_dim=24,
                      launch=DecodeLaunch(2, 16, 2, mma=False), **fp8)  # MHA
_check_rope_attention("cpu", torch.float32, 1e-5, [5, 33], sliding_window=12, softcap=0.5, **fp8)
# decode over a cache already written (transformers' modules, OLMo2): GQA with splits, MHA
_check("cpu", torch.float32, 1e-5, num_seqs=4, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
       seq_lens=[70, 0, 3, 41], launch=DecodeLaunch(2, 16, 2), **fp8)
_check("cpu", torch.float32, 1e-5, num_seqs=3, num_heads=4, num_kv_heads=4, head_dim=24, block_size=8,
       seq_lens=[33, 5, 1], launch=DecodeLaunch(1, 16, 2, mma=False), **fp8)
# the batch-invariant attention (engine.deterministic) over an fp8 cache
from batchgen.kernels.invariant.attention import query_attention
from batchgen.kernels.attention.reference import paged_attention_ref
g = torch.Generator().manual_seed(5)
kc, vc = (as_cached(torch.randn(24, 8, 2, 16, generator=g), KV_FP8) for _ in range(2))
tables = torch.tensor([[3, 5, 7, 0, 0], [1, 2, 4, 6, 8]], dtype=torch.int32)
q = torch.randn(11, 4, 16, generator=g)
out = query_attention(q, kc, vc, tables, torch.tensor(list(range(11, 20)) + [39, 40], dtype=torch.int32),
                      torch.tensor([0] * 9 + [1] * 2, dtype=torch.int32), 0.25)
ref = paged_attention_ref(q, kc, vc, torch.tensor([0, 9, 11], dtype=torch.int32), torch.tensor([19, 40],
                          dtype=torch.int32), tables, 9, 40, 0.25)
torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
# prefill over an fp8 cache (the reference reads the same rounded values: fp32-exact)
_check_prefill("cpu", torch.float32, 1e-5, q_lens=[1, 20, 37, 5], seq_lens=[9, 20, 50, 5], **fp8)
_check_prefill("cpu", torch.float32, 1e-5, q_lens=[17, 3], seq_lens=[17, 40], num_heads=4, num_kv_heads=4,
               head_dim=24, block_size=8, sliding_window=16, **fp8)
# bf16 queries over an fp8 cache attend in fp16 (paged_prefill.query_operand): decode at one split and several,
# prefill (before: fp8 -> bf16 tiles, relative error ~1e9 under the interpreter); a query past fp16's range is
# clamped to +-65504, finite where fp16 would give inf and NaN, as the reference over the clamped query
for launch in (DecodeLaunch(1, 16, 2), DecodeLaunch(2, 16, 2)):
    _check("cpu", torch.bfloat16, 2e-2, num_seqs=4, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
           seq_lens=[70, 0, 3, 41], launch=launch, **fp8)
_check_prefill("cpu", torch.bfloat16, 2e-2, q_lens=[1, 20, 37, 5], seq_lens=[9, 20, 50, 5], **fp8)
from test_kernels import _case, _reference
from batchgen.kernels.attention.paged_decode import paged_decode_attention
query, kc, vc, tables, lens = _case(3, 4, 2, 16, 8, [9, 30, 17], torch.bfloat16, "cpu", seed=4)
query[0, 1, 3], query[2, 0, 5] = 3e5, -1e6
kc, vc = as_cached(kc, KV_FP8), as_cached(vc, KV_FP8)
out = paged_decode_attention(query, kc, vc, tables, lens, 0.25, launch=DecodeLaunch(1, 16, 2))
ref = _reference(query.float().clamp(-65504, 65504), kc, vc, tables, lens, 0.25)
assert out.isfinite().all(), "a query past fp16's range gave inf or NaN"
assert (out.double() - ref).norm() / ref.norm() < 2e-2
# the packed steps' rotary kernel writes the fp8 cache as rope_kv_ref does, saturating past 448
g = torch.Generator().manual_seed(3)
qkv = torch.randn(6, (4 + 2 * 2) * 16, generator=g) * 40.0  # some keys and values past 448 after scaling
qkv[:, -16:] *= 100.0
cos, sin = torch.ones(6, 16), torch.zeros(6, 16)
slots = torch.tensor([3, 9, 17, 30, 31, 12])
for rotate_fp32 in (False, True):  # True: OLMo2's rotation in fp32
    caches = [torch.zeros(4, 8, 2, 16).to(KV_FP8) for _ in range(2)]
    q_ref = rope_kv_ref(qkv, cos, sin, slots, caches[0], caches[1], 4, 2, rotate_fp32=rotate_fp32)
    one_token = None
    for block_tokens in (1, 4):  # one token a program; tiles of 4 (6 tokens: a partial last tile)
        out = [torch.zeros(4, 8, 2, 16).to(KV_FP8) for _ in range(2)]
        q = rope_kv(qkv, cos, sin, slots, out[0], out[1], 4, 2, use_triton=True, rotate_fp32=rotate_fp32,
                    block_tokens=block_tokens)
        torch.testing.assert_close(q, q_ref, atol=0, rtol=0)
        for got, want in zip(out, caches):
            assert (got.float() != want.float()).float().mean() <= 0.06 and fp8_carry_dropped(got, want).all()
        assert out[1].float().abs().max() == 448.0 and not out[1].float().isnan().any()  # saturated, no NaN
        bits = [c.view(torch.uint8) for c in out]
        one_token = one_token or bits
        assert all(torch.equal(a, b) for a, b in zip(bits, one_token)), "a tile's fp8 cache differs from BLOCK_T 1's"
print("ok")
"""


@pytest.mark.skipif(pytest.importorskip("triton") is None, reason="needs triton")
def test_fp8_kv_cache_kernels_match_the_torch_reference_under_triton_interpreter():
    run_under_interpreter(FP8_KV_INTERPRET_SCRIPT)


def test_fp8_cache_writes_saturate_and_read_back_as_the_rounded_values():
    cache = torch.zeros(2, 4, 1, 3).to(KV_FP8)
    key = torch.tensor([[[1000.0, -1000.0, 0.3]], [[1.0, 2.0, 3.0]]])
    write_kv(cache, cache.clone(), key, key, torch.tensor([5, 0]))
    got = cache.float().flatten(0, 1)
    assert got[5].tolist() == [[FP8_MAX, -FP8_MAX, torch.tensor(0.3).to(KV_FP8).item()]]
    assert got[0].tolist() == [[1.0, 2.0, 3.0]] and not got.isnan().any()
    assert as_cached(torch.tensor([0.3]), torch.float32).item() == pytest.approx(0.3)  # other dtypes: a cast


def test_an_fp8_cache_fits_twice_the_blocks_of_a_bf16_one_in_the_same_memory():
    geometry = KVGeometry(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64)
    assert geometry.bytes_per_block(16, KV_FP8) * 2 == geometry.bytes_per_block(16, torch.bfloat16)
    budget = 64 << 20
    plan = [plan_num_blocks(geometry, 16, dtype, torch.device("cpu"), 0.9, reserve_bytes=0, cpu_max_bytes=budget)
            for dtype in (torch.bfloat16, KV_FP8)]
    assert plan[1] in (2 * plan[0], 2 * plan[0] + 1)
    engine = Engine(make_model("llama"), None, EngineConfig(kv_cache_dtype="fp8", cpu_kv_cache_bytes=budget))
    assert engine.kv_cache.k_cache.dtype == KV_FP8 == engine.kv_cache.v_cache.dtype
    engine.close()


def _greedy(model, prompts, config: EngineConfig) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their log-probs."""
    engine = Engine(model, None, config)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    out = [(r.samples[0].token_ids, r.samples[0].logprobs) for r in engine.generate(prompts, params)]
    engine.close()
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
def test_an_fp8_cache_generates_the_tokens_of_the_model_dtype_cache_whose_writes_are_rounded_to_fp8(arch,
                                                                                                     monkeypatch):
    """The engine with engine.kv_cache_dtype: fp8 equals, token for token, the default cache whose every K/V write
    is rounded through fp8 and back (the same values attended to, in the model's dtype): the option reaches every
    write and every read (prefill, decode, chunked prefill, sliding windows, q/k norms)."""
    model = make_model(arch)
    prompts = random_prompts((5, 17, 33, 8), seed=11)
    config = dict(num_kv_blocks=64, block_size=8, max_num_batched_tokens=24)
    got = _greedy(model, prompts, EngineConfig(kv_cache_dtype="fp8", **config))
    write = paged_attention_ref.write_kv

    def rounded_write(k_cache, v_cache, key, value, slots):
        write(k_cache, v_cache, as_cached(key, KV_FP8).to(key.dtype), as_cached(value, KV_FP8).to(value.dtype), slots)

    for module in ("batchgen.kernels.attention.reference", "batchgen.kernels.attention.rope_kv", "batchgen.attention.backend"):
        monkeypatch.setattr(f"{module}.write_kv", rounded_write)
    want = _greedy(model, prompts, EngineConfig(**config))
    assert got == want  # tokens and log-probs, exactly
    monkeypatch.undo()
    plain = _greedy(model, prompts, EngineConfig(**config))
    # the rounding reaches the log-probs (so the equality above is not vacuous)
    assert [lp for _, lp in plain] != [lp for _, lp in want]


def test_the_fingerprint_records_an_fp8_cache_only_when_chosen(tmp_path, tiny_model_dir):
    from jobutil import write_job

    from batchgen.job.job_file import load_spec
    from batchgen.output.fingerprint import check_or_write, components, refusal

    class Tok:
        all_special_tokens: list[str] = []

        @staticmethod
        def get_vocab():
            return {}

    src = {"path": "rows.jsonl"}
    specs = [load_spec(write_job(tmp_path, tiny_model_dir, src, name=f"{name}.yaml", engine=engine))
             for name, engine in (("auto", {}), ("fp8", {"kv_cache_dtype": "fp8"}))]
    auto, fp8 = (components(spec, {}, Tok(), "x") for spec in specs)
    assert auto["engine"] == {"deterministic": False}  # as outputs begun before the option recorded it
    assert fp8["engine"] == {"deterministic": False, "kv_cache_dtype": "fp8"}
    out = tmp_path / "out"
    out.mkdir()
    check_or_write(out, auto)
    assert refusal(out, auto) is None
    assert "engine.kv_cache_dtype: None -> 'fp8'" in refusal(out, fp8)  # resuming with it turned on is refused


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens", [[769] * 32, [7, 200, 1, 0, 33, 161, 16, 1030] * 20,
                                      [7, 200, 1, 0, 33, 161, 16, 1030] * 80])
def test_fp8_cache_decode_and_prefill_on_gpu(seq_lens, monkeypatch):
    """bf16 queries over an fp8 cache on the H100 / H200: the decode kernel (rotary and write fused; GQA at
    Llama-8B's heads, and MHA) attends to exactly what it wrote; its writes are torch's fp8 rounding; the
    prefill kernel matches the reference over the same cache. 640 sequences (Llama-8B's heads only): the
    large-batch launch (2 warps over an fp8 cache, decode_launch.LARGE_BATCH_FP8_WARPS)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "kernels"))  # tests/kernels/test_kernels.py
    from test_kernels import _check_prefill, _check_rope_attention

    _check_rope_attention("cuda", torch.bfloat16, 2e-2, seq_lens, num_heads=32, num_kv_heads=8, head_dim=128,
                          kv_dtype=KV_FP8)
    if len(seq_lens) <= 160:  # MHA at 640 sequences: the float64 reference would take ~15 GiB more
        _check_rope_attention("cuda", torch.bfloat16, 2e-2, seq_lens, num_heads=32, num_kv_heads=32, head_dim=96,
                              kv_dtype=KV_FP8)
    _check_prefill("cuda", torch.bfloat16, 2e-2, q_lens=[1, 200, 37, 513], seq_lens=[900, 200, 50, 1030],
                   num_heads=32, num_kv_heads=8, head_dim=128, kv_dtype=KV_FP8)


def test_an_fp8_cache_is_refused_by_key_on_a_gpu_before_compute_capability_8_9(monkeypatch):
    from batchgen.attention.kv_cache import KVCacheUnsupported, cache_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(KVCacheUnsupported, match=r"engine.kv_cache_dtype: fp8 needs a GPU of compute capability "
                                                 r"8.9 or later .*A100-SXM4-80GB is 8.0"):
        cache_dtype("fp8", torch.bfloat16, torch.device("cuda", 0))
    assert cache_dtype("auto", torch.bfloat16, torch.device("cuda", 0)) == torch.bfloat16  # auto: never refused
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cache_dtype("fp8", torch.bfloat16, torch.device("cuda", 0)) == KV_FP8
    assert cache_dtype("fp8", torch.float32, torch.device("cpu")) == KV_FP8

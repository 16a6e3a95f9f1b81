"""The fused decode and packed forwards (every family in ARCHS and MOE_ARCHS) on CPU: same weights as transformers, no copy,
the same logits, exact greedy; and the reason stated wherever a model falls back to transformers' modules."""

from __future__ import annotations

import pytest
import torch

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.models.llama import LlamaDecoder
from batchgen.models.registry import DECODERS, unsupported_reason
from batchgen.attention.kv_cache import KVCache, KVGeometry
from conftest import ARCHS, MOE_ARCHS, hf_greedy, make_model, one_sequence_meta, random_prompts


def _cache(model):
    return KVCache(KVGeometry.from_config(model.config), 8, 16, torch.float32, torch.device("cpu"))


def test_fusing_keeps_one_copy_of_the_weights_and_leaves_transformers_forward_unchanged():
    model = make_model("qwen2")  # q/k/v with biases
    ids = torch.tensor([random_prompts((12,))[0]])
    before = model(ids).logits
    decoder = LlamaDecoder(model, _cache(model), use_triton=False)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    fused = decoder.layers[0]
    assert attn.q_proj.weight.data_ptr() == fused.qkv_weight.data_ptr()
    assert attn.v_proj.bias.data_ptr() + attn.v_proj.bias.numel() * 4 == \
        fused.qkv_bias.data_ptr() + fused.qkv_bias.numel() * 4
    assert mlp.up_proj.weight.data_ptr() == fused.mlp.gate_up_weight.data_ptr() + mlp.gate_proj.weight.numel() * 4
    torch.testing.assert_close(model(ids).logits, before, atol=0, rtol=0)
    again = LlamaDecoder(model, _cache(model), use_triton=False)  # a second engine on the same model
    assert again.layers[0].qkv_weight.data_ptr() == fused.qkv_weight.data_ptr()


# qwen3: per-head q/k norms; gemma: (1 + w) norms, GELU-tanh gate; phi3: fused checkpoint weights; olmo2: post-norms,
# whole-q/k norms; granite: multipliers; starcoder2: LayerNorm with bias, biases, plain GELU MLP; the MoE
# families: their routers, the grouped experts, Qwen2-MoE's shared expert and biased q/k/v, Qwen3-MoE's q/k norms
@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS)
def test_engine_prefills_and_decodes_through_the_fused_forward_and_matches_transformers_generate(arch):
    model = make_model(arch)
    prompts = random_prompts((5, 17, 33, 8))
    expected = [hf_greedy(model, p, 12) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=16))
    assert engine.runner.decode_forward.is_fused and engine.runner.decode_forward.name == "fused"
    assert engine.decode_path == "fused"
    fused, calls = engine.runner.decode_forward, []
    decode, packed = fused.forward, fused.forward_packed
    fused.forward = lambda *a: calls.append("decode") or decode(*a)
    fused.forward_packed = lambda *a: calls.append("packed") or packed(*a)
    got = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    assert [r.samples[0].token_ids for r in got] == expected
    assert calls.count("decode") >= 11 and calls.count("packed") >= 1  # every step went through it


def _phi3_longrope(**overrides):
    """A Phi-3 with LongRoPE: short/long factors far from 1, a 4x context extension (attention scaling != 1)."""
    g = torch.Generator().manual_seed(5)
    half = 8  # head_dim 16 / 2
    rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=256,
                short_factor=(1.0 + 3.0 * torch.rand(half, generator=g)).tolist(),
                long_factor=(4.0 + 8.0 * torch.rand(half, generator=g)).tolist())
    # Phi3Config writes its own original_max_position_embeddings field into rope_parameters: set both
    return make_model("phi3", max_position_embeddings=1024, original_max_position_embeddings=256,
                      rope_parameters=rope, **overrides)


def test_fused_decoder_is_used_only_where_the_architecture_allows_and_says_why_not():
    assert unsupported_reason(make_model("phi3"), 1024) is None
    assert unsupported_reason(make_model("gemma", hidden_act="gelu_pytorch_tanh"), 1024) is None
    assert unsupported_reason(make_model("gemma", hidden_act="relu"), 1024) == "activation 'relu'"
    for arch in ("mistral", "starcoder2", "phi3"):  # windows shorter than the context: served by the kernels
        assert unsupported_reason(make_model(arch, sliding_window=16), 1024) is None
    longrope = _phi3_longrope()
    assert unsupported_reason(longrope, 256) is None  # inside the original context: the short factors, static
    assert unsupported_reason(longrope, 257) == ("rope type 'longrope' with max_model_len 257 > "
                                                 "original_max_position_embeddings 256 (its frequencies switch "
                                                 "with the sequence length)")
    partial = make_model("phi3", rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                      partial_rotary_factor=0.5))
    assert unsupported_reason(partial, 1024) == "partial rotary (8 of 16 head dims)"
    assert unsupported_reason(make_model("starcoder2", hidden_act="relu"), 1024) == "activation 'relu'"
    assert unsupported_reason(make_model("granite", mlp_bias=True), 1024) == "MLP biases"
    engine = Engine(make_model("llama"), None, EngineConfig(num_kv_blocks=8, fused_decoder=False))
    assert engine.runner.decode_forward.name == "transformers (off)" and engine.decode_path == "transformers"


def test_an_unsupported_config_decodes_through_transformers_and_the_engine_says_why():
    model = _phi3_longrope()  # max_model_len defaults to max_position_embeddings 1024 > 256
    engine = Engine(model, None, EngineConfig(num_kv_blocks=16, block_size=16))
    assert engine.decode_path == "transformers"
    assert engine.runner.decode_forward.name.startswith("transformers (rope type 'longrope' with max_model_len 1024")
    fused = Engine(make_model("olmo2"), None, EngineConfig(num_kv_blocks=8))
    assert fused.decode_path == "fused"
    fused.close()
    assert fused.decode_path == "fused"  # still readable after close


def test_phi3_longrope_within_its_original_context_runs_fused_and_matches_transformers_generate():
    model = _phi3_longrope()
    assert model.model.rotary_emb.attention_scaling > 1.0
    prompts = random_prompts((5, 40, 17))
    expected = [hf_greedy(model, p, 12) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=32, block_size=16, max_model_len=256))
    assert engine.decode_path == "fused" and engine.runner.decode_forward.cos_table.shape == (256, 16)
    got = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    assert [r.samples[0].token_ids for r in got] == expected


def test_phi3_reads_its_checkpoint_fused_qkv_and_gate_up_weights_without_copies():
    model = make_model("phi3")
    decoder = DECODERS["phi3"](model, _cache(model), use_triton=False)
    layer, fused = model.model.layers[0], decoder.layers[0]
    assert fused.qkv_weight.data_ptr() == layer.self_attn.qkv_proj.weight.data_ptr()
    assert fused.mlp.gate_up_weight.data_ptr() == layer.mlp.gate_up_proj.weight.data_ptr()


@pytest.mark.parametrize("arch", ARCHS + MOE_ARCHS)
def test_packed_forward_logits_equal_transformers_forward_logits(arch):
    """Sharper than greedy tokens: quirks that rarely flip an argmax (Granite's logits_scaling never does, a
    LayerNorm bias seldom) still show in the logits. fp32 on CPU: the same ops in the same order."""
    model = make_model(arch)
    ids = random_prompts((20,))[0]
    expected = model(torch.tensor([ids])).logits[0]  # [T, V]
    cache = _cache(model)
    decoder = DECODERS[arch](model, cache, use_triton=False)
    n = len(ids)
    meta = one_sequence_meta(cache, n)
    got = decoder.forward_packed(torch.tensor(ids), torch.arange(n), meta, torch.arange(n))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_fused_decoder_that_fails_on_the_device_falls_back_to_transformers_and_says_why(monkeypatch):
    model = make_model("llama")
    prompts = random_prompts((6, 11))
    expected = [hf_greedy(model, p, 5) for p in prompts]

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr("batchgen.models.blocks.rope_kv", broken)
    with pytest.warns(UserWarning, match="fused decoder failed on cpu: RuntimeError: no kernel image"):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=16, block_size=16))
    assert engine.runner.decode_forward.name.startswith("transformers (the fused")
    got = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    assert [r.samples[0].token_ids for r in got] == expected


FUSED_STEP_INTERPRET_SCRIPT = """
import torch, sys
sys.path.insert(0, "tests")
import few_splits
from conftest import make_model
from batchgen.models.registry import DECODERS
few_splits.install()  # 2 KV splits, not the table's 16-32 mostly empty ones (tests/few_splits.py)
from batchgen.attention.kv_cache import KVCache, KVGeometry
# llama: rotary in the attention kernel; qwen3: its q/k norm there too; gemma: (1 + w) norms, GELU-tanh gate;
# phi3: checkpoint-fused weights; olmo2: whole-q/k norms in place, fp32 rotary; granite: multipliers;
# starcoder2: LayerNorm, biases, plain GELU MLP
for arch in sys.argv[1:]:
    model = make_model(arch)
    caches = [KVCache(KVGeometry.from_config(model.config), 8, 16, torch.float32, torch.device("cpu")) for _ in "ab"]
    g = torch.Generator().manual_seed(0)
    context_k, context_v = torch.randn(caches[0].k_cache.shape, generator=g), torch.randn(caches[0].v_cache.shape, generator=g)
    for c in caches:
        c.k_cache.copy_(context_k)
        c.v_cache.copy_(context_v)
    seq_lens = torch.tensor([5, 17, 1, 0], dtype=torch.int32)  # the new token included; 0: a padding row
    tables = torch.tensor([[0, 1], [2, 3], [4, 5], [8, 8]], dtype=torch.int32)  # block 8: the trash block
    pos = (seq_lens.long() - 1).clamp(min=0)
    slots = torch.where(seq_lens > 0, tables.long()[torch.arange(4), pos // 16] * 16 + pos % 16, caches[0].trash_slot)
    ids = torch.randint(3, model.config.vocab_size, (4,), generator=g)
    decoder_cls = DECODERS[arch]
    logits = [decoder_cls(model, c, use_triton=tri)(ids, pos, slots, tables, seq_lens) for c, tri in zip(caches, (True, False))]
    torch.testing.assert_close(logits[0][:3], logits[1][:3], atol=1e-4, rtol=1e-4)
    real = slice(0, 8)  # the reference also writes the padding row's K/V into the trash block
    torch.testing.assert_close(caches[0].k_cache[:, real], caches[1].k_cache[:, real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[0].v_cache[:, real], caches[1].v_cache[:, real], atol=1e-5, rtol=1e-5)
    # a packed (mixed) step: two decode rows first, then a 5-token prefill chunk after 3 cached tokens
    import numpy as np
    from batchgen.attention.backend import AttentionMetadata
    from batchgen.kernels.attention.prefill_launch import PrefillWork
    q_lens, seq_lens = np.array([1, 1, 5]), np.array([9, 2, 8])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    pos = torch.tensor([8, 1, 3, 4, 5, 6, 7])
    seq_of = torch.tensor([0, 1, 2, 2, 2, 2, 2])
    slots = tables.long()[seq_of, pos // 16] * 16 + pos % 16
    ids = torch.randint(3, model.config.vocab_size, (7,), generator=g)
    keep = torch.tensor([0, 1, 6])
    logits = []
    for c, tri in zip(caches, (True, False)):
        meta = AttentionMetadata(kv_cache=c, slot_mapping=slots, query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                                 max_query_len=5, max_seq_len=9, use_triton=tri, num_decode_seqs=2,
                                 prefill_work=PrefillWork.build(q_lens, qsl) if tri else None)
        logits.append(decoder_cls(model, c, use_triton=tri).forward_packed(ids, pos, meta, keep))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[0].k_cache[:, real], caches[1].k_cache[:, real], atol=1e-5, rtol=1e-5)
print("ok")
"""


def run_fused_steps_under_interpreter(archs: list[str]) -> None:
    """FUSED_STEP_INTERPRET_SCRIPT over `archs` with the kernels interpreted, each launch first compiled for sm_90
    (conftest.run_under_interpreter's Hopper mode: every kernel specialisation a real decoder launches), in two
    processes at once (the interpreter is single-threaded Python; CI machines have 2 cores); each must print ok."""
    import os
    import subprocess
    import sys

    from conftest import HOPPER_PRELUDE
    from jobutil import REPO

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = HOPPER_PRELUDE + FUSED_STEP_INTERPRET_SCRIPT
    procs = [subprocess.Popen([sys.executable, "-c", script, *archs[i::2]], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO)
             for i in range(min(2, len(archs)))]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0 and "ok" in stdout, stderr[-3000:]


def test_fused_decode_and_packed_steps_with_triton_kernels_match_the_reference_path_under_triton_interpreter():
    """The decoder's wiring of its Triton kernels (QKV layout, rotary tables, slots, block tables) on CPU, for a
    decode step and for a packed step (decode rows, then a prefill chunk)."""
    pytest.importorskip("triton")
    run_fused_steps_under_interpreter(["llama", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
                                       "granite", "starcoder2"])


def test_gemma3_ignores_attn_logit_softcapping_as_transformers_does():
    """Gemma3's attention module stores the config's attn_logit_softcapping but never applies it."""
    model = make_model("gemma3_text", attn_logit_softcapping=0.5)
    prompts = random_prompts((5, 17, 33))
    expected = [hf_greedy(model, p, 10) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=16))
    assert engine.decode_path == "fused"
    got = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    assert [r.samples[0].token_ids for r in got] == expected


@pytest.mark.parametrize("arch,window", [("mistral", dict(sliding_window=8)), ("starcoder2", dict(sliding_window=8)),
                                         ("phi3", dict(sliding_window=8)),
                                         ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1))])
def test_sliding_window_layers_run_fused_and_match_transformers_generate(arch, window):
    """Mistral / Starcoder2 / Phi3 slide on every layer, Qwen2 on the layers from max_window_layers on; prompts
    longer than the window make it bind (a window ignored or misplaced changes the tokens)."""
    model = make_model(arch, **window)
    prompts = random_prompts((5, 17, 33, 40))
    expected = [hf_greedy(model, p, 12) for p in prompts]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=24))
    assert engine.decode_path == "fused"
    windows = [layer.sliding_window for layer in engine.runner.decode_forward.layers]
    assert windows == ([None, 8] if arch == "qwen2" else [8, 8])
    got = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    assert [r.samples[0].token_ids for r in got] == expected
    # sharper than greedy tokens (a tiny model may repeat one token): the packed forward's logits over a prompt
    # longer than the window equal transformers', and differ from the same model's without the window
    ids = prompts[3]
    expected_logits = model(torch.tensor([ids])).logits[0]
    cache = _cache(model)
    n = len(ids)
    meta = one_sequence_meta(cache, n)
    decoder = DECODERS[arch](model, cache, use_triton=False)
    got_logits = decoder.forward_packed(torch.tensor(ids), torch.arange(n), meta, torch.arange(n))
    torch.testing.assert_close(got_logits, expected_logits, atol=1e-5, rtol=1e-5)
    unwindowed = make_model(arch, **{**window, "sliding_window": 4096})
    assert (unwindowed(torch.tensor([ids])).logits[0] - expected_logits).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["llama", "granite"])
def test_an_odd_vocabulary_gets_a_padded_lm_head_over_the_same_bytes_and_matches_transformers(arch):
    """Granite's 49,155 rows left cuBLAS only unaligned kernels on the H200: the head's rows are padded to a
    multiple of 64 for the GEMM and the logits trimmed; the module keeps reading the same bytes (a view)."""
    from batchgen.models.weights import HEAD_ROW_MULTIPLE, PaddedHead

    model = make_model(arch, vocab_size=509, tie_word_embeddings=True)
    prompts = random_prompts((5, 17, 33), vocab_size=509)
    expected = [hf_greedy(model, p, 10) for p in prompts]
    ids = random_prompts((20,), vocab_size=509)[0]
    logits = model(torch.tensor([ids])).logits[0]  # [T, V]
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, block_size=16))
    head = engine.runner.decode_forward.lm_head
    assert isinstance(head, PaddedHead) and head.weight.shape[0] == 512 == -(-509 // HEAD_ROW_MULTIPLE) * 64
    assert model.lm_head.weight.data_ptr() == head.weight.data_ptr() and model.lm_head.weight.shape[0] == 509
    assert model.model.embed_tokens.weight is model.lm_head.weight  # still tied: one Parameter
    assert not head.weight[509:].any()
    got = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    assert [r.samples[0].token_ids for r in got] == expected
    cache = _cache(model)
    decoder = DECODERS[arch](model, cache, use_triton=False)
    packed = decoder.forward_packed(torch.tensor(ids), torch.arange(len(ids)), one_sequence_meta(cache, len(ids)),
                                    torch.arange(len(ids)))
    assert packed.shape == logits.shape and packed.is_contiguous()
    torch.testing.assert_close(packed, logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(torch.tensor([ids])).logits[0], logits, atol=0, rtol=0)  # transformers unchanged
    again = Engine(model, None, EngineConfig(num_kv_blocks=8)).runner.decode_forward.lm_head  # a second engine
    assert again.weight.data_ptr() == head.weight.data_ptr() and model.lm_head.weight.shape[0] == 509

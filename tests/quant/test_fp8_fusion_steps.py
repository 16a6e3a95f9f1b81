"""The FP8 hand-offs (quant/fusion.py) in whole steps: FP8 decode and packed steps with the hand-offs on and
off give the same logits and K/V cache with fewer launches, under the Triton interpreter (every launch also compiled
for sm_90; the GPU's path choices forced on CPU tensors: fp8_gemm.gemm_path patched to split-K for decode rows and
the Triton GEMM above, split-K splitting even the tiny models' few scale blocks), on the CPU reference path and in a
GPU engine with CUDA graphs; and where the decoders ask for them. The kernels one by one:
tests/quant/test_fp8_fusion_kernels.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from conftest import HOPPER_PRELUDE, make_model, make_tokenizer, needs_interpreter, random_prompts  # noqa: E402
from jobutil import REPO  # noqa: E402

from batchgen.kernels.fp8.quant import ActQuant, Fp8Weight, quantize_weight  # noqa: E402
from batchgen.quant.fusion import HandOffs  # noqa: E402



STEPS_SCRIPT = r"""
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, "tests")
import few_splits
import hopper_compile
from conftest import make_model, make_tokenizer
from fp8_checkpoints import save_fp8_checkpoint
from fp8_fusion_cases import same_bits

from batchgen.attention.backend import AttentionMetadata
from batchgen.attention.kv_cache import KVCache, KVGeometry
from batchgen.kernels.fp8 import gemm as fp8_gemm
from batchgen.kernels.fp8 import splitk_common
from batchgen.kernels.attention.prefill_launch import PrefillWork
from batchgen.models.registry import DECODERS
from batchgen.runner.loader import load_model

# the GPU's choices on CPU tensors: split-K for the decode step's 4 rows, the Triton GEMM for the packed step's 7;
# splits over the tiny model's few 32-column blocks (o: 2, down: 4), so that partials reach the norms
few_splits.install()  # 2 KV splits, not the table's 16-32 mostly empty ones (tests/few_splits.py)
fp8_gemm.gemm_path = lambda device, dtype, n, k, group_n, group_k, act_quant, rows=None: \
    "splitk" if rows <= 4 else "triton"
splitk_common.MIN_BLOCKS_PER_SPLIT = 1
# launches saved per layer (quantize_groups, split-K reductions) at the decode step: q/k/v, gate/up, down inputs
# quantised by their norm / activation; o and down summed by the next norm. OLMo2's q/k/v and gate/up read the
# residual stream itself (no kernel writes it); Starcoder2's LayerNorm quantises and sums apart (no launch saved
# there);
# Qwen3-MoE: its attention's (the experts keep their own quantisers). The packed step (Triton GEMM, no split-K):
# the quantisers only
# The decode attention kernel sums q/k/v's partials (one reduction less where the layer runs blocks.self_attention:
# not Gemma2's or OLMo2's own loops) and quantises o's input where a head is whole groups: 16-dim heads are not
# (the 32-column groups of these checkpoints), llama_hd32's 32-dim heads are.
SAVED = {"llama": (3, 3), "granite": (3, 3), "gemma2": (3, 2), "olmo2": (1, 2), "starcoder2": (0, 1),
         "qwen3_moe": (1, 2), "llama_hd32": (4, 3)}
PACKED_SAVED = {"llama": (3, 0), "olmo2": (1, 0)}
VARIANTS = {"llama_hd32": ("llama", {"head_dim": 32})}  # name -> (architecture, config overrides)


def launches(run):
    before = hopper_compile.compiled()
    out = run()
    after = hopper_compile.compiled()
    return out, {name: after[name] - before.get(name, 0) for name in after}


def decode_step(decoder, cache):
    seq_lens = torch.tensor([5, 17, 1, 0], dtype=torch.int32)  # the new token included; 0: a padding row
    tables = torch.tensor([[0, 1], [2, 3], [4, 5], [8, 8]], dtype=torch.int32)  # block 8: the trash block
    pos = (seq_lens.long() - 1).clamp(min=0)
    slots = torch.where(seq_lens > 0, tables.long()[torch.arange(4), pos // 16] * 16 + pos % 16, cache.trash_slot)
    return decoder(torch.tensor([5, 9, 13, 17]), pos, slots, tables, seq_lens)


def packed_step(decoder, cache):
    # two decode rows, then a 5-token prefill chunk after 3 cached tokens
    q_lens, seq_lens = np.array([1, 1, 5]), np.array([9, 2, 8])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    pos = torch.tensor([8, 1, 3, 4, 5, 6, 7])
    slots = tables.long()[torch.tensor([0, 1, 2, 2, 2, 2, 2]), pos // 16] * 16 + pos % 16
    meta = AttentionMetadata(kv_cache=cache, slot_mapping=slots, query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                             max_query_len=5, max_seq_len=9, use_triton=True, num_decode_seqs=2,
                             prefill_work=PrefillWork.build(q_lens, qsl))
    return decoder.forward_packed(torch.tensor([3, 7, 11, 15, 19, 23, 27]), pos, meta, torch.tensor([0, 1, 6]))


tok = make_tokenizer()
for name in sys.argv[1:]:
    arch, overrides = VARIANTS.get(name, (name, {}))
    with tempfile.TemporaryDirectory() as folder:
        model = make_model(arch, vocab_size=len(tok), **overrides)
        path = save_fp8_checkpoint(model, tok, Path(folder) / name, "block")
        model = load_model(str(path), "bfloat16", "cpu")  # 32x32 blocks, bf16 activations
    cls, layers = DECODERS[arch], model.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    caches = [KVCache(KVGeometry.from_config(model.config), 8, 16, torch.bfloat16, torch.device("cpu")) for _ in "ab"]
    context = [torch.randn(caches[0].k_cache.shape, generator=g).bfloat16() for _ in "kv"]
    for c in caches:
        c.k_cache.copy_(context[0])
        c.v_cache.copy_(context[1])
    decoders = []
    for fuse, cache in zip((True, False), caches):
        cls.gemm_hand_offs = fuse
        decoders.append(cls(model, cache, use_triton=True))
    assert decoders[0].fusion is not None and decoders[1].fusion is None
    steps = [(decode_step, SAVED[name])] + ([(packed_step, PACKED_SAVED[name])] if name in PACKED_SAVED else [])
    for step, saved in steps:
        (fused, n_fused), (plain, n_plain) = (launches(lambda: step(d, c)) for d, c in zip(decoders, caches))
        assert same_bits(fused, plain), (name, step.__name__, (fused.float() - plain.float()).abs().max())
        assert same_bits(caches[0].k_cache, caches[1].k_cache) and same_bits(caches[0].v_cache, caches[1].v_cache)
        got = tuple(n_plain.get(k, 0) - n_fused.get(k, 0) for k in ("_quantize_groups_kernel", "_splitk_reduce_kernel"))
        assert got == (saved[0] * layers, saved[1] * layers), (name, step.__name__, n_fused, n_plain)
print("ok")
"""


@needs_interpreter
def test_fp8_decode_and_packed_steps_give_the_same_logits_and_cache_with_fewer_launches_fused_under_interpreter():
    """Llama (and Granite's branch scale, Qwen3-MoE's attention, 32-dim heads whose attention output is quantised
    in the attention kernel) through LlamaDecoder's loop, Gemma2's and OLMo2's own loops, Starcoder2's LayerNorm
    (the hand-offs summed and quantised apart), in two processes (2 CPU cores)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}  # a core each
    procs = [subprocess.Popen([sys.executable, "-c", HOPPER_PRELUDE + STEPS_SCRIPT, *archs], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO)
             for archs in (["olmo2", "starcoder2", "granite", "llama_hd32"], ["llama", "gemma2", "qwen3_moe"])]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0 and "ok" in stdout, stderr[-3000:]


CUDA0 = torch.device("cuda", 0)  # the path choice reads the device's type and index only: no GPU needed


def test_input_quant_asks_for_quantised_inputs_only_where_the_gemm_path_reads_quantize_groups_output(monkeypatch):
    from batchgen.kernels.fp8 import blockwise as fp8_blockwise
    from batchgen.kernels.fp8.gemm import input_quant

    bf16, g = torch.bfloat16, torch.Generator().manual_seed(0)
    block = Fp8Weight(*quantize_weight(torch.randn(256, 512, generator=g), 128, 128), 128, 128, True, scale_ub=1200.0)
    for supported in (True, False):  # split-K up to 32 rows, then cuBLASLt block-wise or the Triton GEMM: all read it
        monkeypatch.setattr(fp8_blockwise, "blockwise_scaled_mm_supported", lambda index, s=supported: s)
        for rows in (1, 32, 33, 256):
            assert input_quant(block, rows, bf16, CUDA0) == ActQuant(128, 1200.0), (supported, rows)
        for path in ("triton", "splitk"):  # engine.fp8_gemm
            assert input_quant(block, 256, bf16, CUDA0, path) == ActQuant(128, 1200.0)
    small = Fp8Weight(*quantize_weight(torch.randn(256, 512, generator=g), 32, 32), 32, 32, True)
    assert input_quant(small, 64, torch.float16, CUDA0) == ActQuant(32)  # the Triton GEMM, groups of 32
    # per channel (row-wise _scaled_mm; the Triton GEMM's CHANNEL_ACT_GROUP, left to quantize_groups), weight-only
    # checkpoints, CPU (the dequantising reference): none
    channel = Fp8Weight(*quantize_weight(torch.randn(256, 512, generator=g), None, None), 1, None, True)
    assert input_quant(channel, 32, bf16, CUDA0) is None and input_quant(channel, 32, torch.float16, CUDA0) is None
    assert input_quant(dataclasses.replace(block, act_quant=False), 32, bf16, CUDA0) is None
    assert input_quant(block, 32, bf16, torch.device("cpu")) is None
    x = torch.randn(4, 512, dtype=bf16)  # the decoder's view: a plain weight, an FP8 one on CPU
    assert HandOffs().input_quant(torch.randn(256, 512), x) is None and HandOffs().input_quant(block, x) is None


def _decode_inputs(cache):
    seq_lens = torch.tensor([5, 17, 1, 0], dtype=torch.int32)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5], [8, 8]], dtype=torch.int32)
    pos = (seq_lens.long() - 1).clamp(min=0)
    slots = torch.where(seq_lens > 0, tables.long()[torch.arange(4), pos // 16] * 16 + pos % 16, cache.trash_slot)
    return torch.tensor([5, 9, 13, 17]), pos, slots, tables, seq_lens


def test_the_cpu_reference_path_takes_no_fp8_hand_offs_so_its_logits_are_the_unfused_ones(tmp_path, monkeypatch):
    """Without Triton the norms, activation and GEMMs are torch references: the decoder asks for no hand-off (with
    Triton it does, and with engine.deterministic it does not), and its FP8 logits are those of the unfused one."""
    from fp8_checkpoints import save_fp8_checkpoint
    from fp8_fusion_cases import same_bits

    from batchgen.attention.kv_cache import KVCache, KVGeometry
    from batchgen.models.llama import LlamaDecoder
    from batchgen.runner.loader import load_model

    tok = make_tokenizer()
    folder = save_fp8_checkpoint(make_model("llama", vocab_size=len(tok)), tok, tmp_path / "fp8", "block")
    model = load_model(str(folder), "bfloat16", "cpu")
    logits = []
    for fuse in (True, False):
        monkeypatch.setattr(LlamaDecoder, "gemm_hand_offs", fuse)
        cache = KVCache(KVGeometry.from_config(model.config), 8, 16, torch.bfloat16, torch.device("cpu"))
        decoder = LlamaDecoder(model, cache, use_triton=False)
        assert decoder.fusion is None
        logits.append(decoder(*_decode_inputs(cache)))
        assert LlamaDecoder(model, cache, use_triton=True).fusion == (HandOffs("auto") if fuse else None)
        assert LlamaDecoder(model, cache, use_triton=True, fp8_gemm="splitk").fusion == \
            (HandOffs("splitk") if fuse else None)
        assert LlamaDecoder(model, cache, use_triton=True, deterministic=True).fusion is None
    assert same_bits(logits[0], logits[1])


@pytest.mark.gpu
def test_fp8_engine_with_cuda_graphs_generates_the_same_tokens_and_logprobs_fused_and_unfused_on_gpu(tmp_path,
                                                                                                   monkeypatch):
    """128x128 blocks, hidden 2048 and MLP 4096: at decode rows o splits K in 2 and down in 4 (>= 8 blocks a
    split), so partials reach the norms; prefill through cuBLASLt block-wise or the Triton GEMM."""
    from fp8_checkpoints import save_fp8_checkpoint

    from batchgen.engine.config import EngineConfig
    from batchgen.engine.engine import Engine
    from batchgen.models.llama import LlamaDecoder
    from batchgen.runner.loader import load_model
    from batchgen.sampling_params import SamplingParams

    tok = make_tokenizer()
    dims = dict(hidden_size=2048, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4)
    folder = save_fp8_checkpoint(make_model("llama", vocab_size=len(tok), **dims), tok, tmp_path / "fp8", "block128")
    model = load_model(str(folder), "bfloat16", "cuda")
    prompts = random_prompts([5, 9, 13, 17, 40], vocab_size=len(tok), seed=3)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = []
    for fuse in (True, False):
        monkeypatch.setattr(LlamaDecoder, "gemm_hand_offs", fuse)
        engine = Engine(model, tok, EngineConfig(cuda_graphs=True, max_num_seqs=8))
        assert (engine.runner.decode_forward.fusion is not None) == fuse
        outs.append([(r.samples[0].token_ids, r.samples[0].logprobs) for r in engine.generate(prompts, params)])
        engine.close()
    assert outs[0] == outs[1]

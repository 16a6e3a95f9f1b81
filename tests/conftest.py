"""Shared fixtures: tiny random models built from configs and a tokenizer trained in memory (no downloads)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import numpy
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _share_cores_between_xdist_workers() -> None:
    """Under pytest-xdist (`make test` runs `-n auto`) each worker is a process of its own, and torch starts one
    intra-op thread per core in each: N workers x N threads on N cores. Each worker takes cores // workers
    threads (at least 1), and so do the processes its tests start (they inherit OMP_NUM_THREADS: CLI runs,
    interpreter scripts; tensor-parallel ranks set their own). An OMP_NUM_THREADS set by the caller wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_cores_between_xdist_workers()


def _area_folders_are_no_packages() -> None:
    """tests/ is on sys.path (pytest puts the root conftest's folder there: `from jobutil import ...`), so a
    tests/<area>/ folder named like a package that is not installed would import as an empty namespace package:
    tests/ray/ as `ray` where Ray is absent, and pytest.importorskip("ray") would not skip. Such a name imports as
    missing instead (not one the repository's root has a folder of too: scripts import `bench.` from there)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.startswith("_") or not name.isidentifier() or name in sys.modules:
            continue
        if not os.path.isdir(os.path.join(here, name)) or os.path.isdir(os.path.join(os.path.dirname(here), name)):
            continue
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin in (None, "namespace") and all(
                os.path.dirname(os.path.abspath(path)) == here for path in spec.submodule_search_locations):
            sys.modules[name] = None


_area_folders_are_no_packages()

# Triton 3.6's interpreter fails on numpy >= 2.4 (InterpreterError: only 0-dimensional arrays can be converted to
# Python scalars): the interpreter tests are skipped there, saying so
NUMPY_TOO_NEW = tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4)
needs_interpreter = pytest.mark.skipif(NUMPY_TOO_NEW, reason=f"numpy {numpy.__version__} >= 2.4: Triton 3.6's "
                                       "interpreter needs numpy < 2.4")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Write a short poem about the sea. Explain photosynthesis to a child.",
    "Summarize the history of Rome in three sentences. List five uses of a paperclip.",
    "def add(a, b):\n    return a + b\n# STOP here, END of text. Hello world! 1234567890",
    "Ünïcödé tëxt, émojis 🙂 and symbols: <>[]{}()#@$%^&*+=-_~`|\\/;:'\",.?!",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.cache
def make_tokenizer():
    """A byte-level BPE tokenizer (vocab ~400) with BOS/EOS/PAD and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


# the families with batchgen's fused forwards
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
         "starcoder2")
# the Mixture-of-Experts families with fused forwards (kept apart: their GEMM layout differs, and the GPU tests'
# runtime over ARCHS stays as it is)
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
# config values that make each family's quirks visible in greedy outputs (multipliers far from 1)
ARCH_OVERRIDES = {
    "granite": dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1,
                    logits_scaling=2.5),
    # a window shorter than most test prompts, caps low enough to bind, a scale other than head_dim ** -0.5
    "gemma2": dict(head_dim=16, sliding_window=8, attn_logit_softcapping=1.5, final_logit_softcapping=6.0,
                   query_pre_attn_scalar=9),
    "gemma3_text": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=9,
                        layer_types=["sliding_attention", "full_attention"]),
    # 8 experts, top-2: over short prompts some experts get no token; Qwen3-MoE renormalises the top-k (as
    # Qwen3-30B-A3B does), Qwen2-MoE does not (its default, Qwen1.5-MoE's), Mixtral always does
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                      num_experts_per_tok=2, qkv_bias=True),
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
}


def make_model(arch: str = "llama", vocab_size: int = 512, seed: int = 0, num_layers: int = 2, **overrides):
    """A tiny random fp32 decoder of the given architecture."""
    import transformers as T

    classes = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "mistral": (T.MistralConfig, T.MistralForCausalLM),
               "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM), "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
               "gemma": (T.GemmaConfig, T.GemmaForCausalLM), "phi3": (T.Phi3Config, T.Phi3ForCausalLM),
               "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM), "granite": (T.GraniteConfig, T.GraniteForCausalLM),
               "starcoder2": (T.Starcoder2Config, T.Starcoder2ForCausalLM),
               "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM), "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM),
               "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM),
               "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM),
               "mixtral": (T.MixtralConfig, T.MixtralForCausalLM)}
    config_cls, model_cls = classes[arch]
    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if arch in ("qwen3", "gemma", "qwen3_moe"):
        kwargs["head_dim"] = 16
    kwargs.update(ARCH_OVERRIDES.get(arch, {}))
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    # Random init gives near-uniform logits; sharpen them so greedy ties (fp noise flips) are implausible.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        if arch.startswith("gemma"):  # Gemma's norm weights start at 0 (a scale of 1): make the (1 + w) visible
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
        if arch in ("phi3", "olmo2", "granite", "starcoder2"):  # norms not at 1, biases not at 0: quirks matter
            for name, p in model.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    p.normal_(1.0, 0.3)
                elif name.endswith("bias"):  # Starcoder2's q/k/v/o, MLP and LayerNorm biases
                    p.normal_(0.0, 0.1)
        if arch in MOE_ARCHS:  # decisive routing (init logits are ~0: near-ties), biases and norms visible
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                    p.mul_(25.0)
                elif name.endswith("bias") or ("norm" in name and name.endswith("weight")):
                    p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


def one_sequence_meta(cache, num_tokens: int):
    """AttentionMetadata of a packed step that prefills one sequence of `num_tokens` from position 0 into the
    first blocks of `cache` (a decoder's forward_packed over a whole prompt)."""
    from batchgen.attention.backend import AttentionMetadata

    n, blocks = num_tokens, -(-num_tokens // cache.block_size)
    return AttentionMetadata(kv_cache=cache, slot_mapping=torch.arange(n), max_query_len=n, max_seq_len=n,
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.arange(blocks, dtype=torch.int32)[None])


@pytest.fixture
def tokenizer():
    return make_tokenizer()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, repetition_penalty: float = 1.0) -> list[int]:
    """transformers' own greedy generate for one prompt, EOS ignored (EOS may be generated like any token)."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             repetition_penalty=repetition_penalty)
    finally:
        model.generation_config.eos_token_id = saved
    generated = out[0, len(prompt_ids):].tolist()
    assert len(generated) == max_new_tokens
    return generated


def hf_token_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-prob of each of `tokens` after `prompt` and the tokens before it [len(tokens)]."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def random_prompts(lengths, vocab_size: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from jobutil import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("model"))


# what a script runs first in Hopper compile mode (tests/hopper_compile.py)
HOPPER_PRELUDE = "import sys; sys.path.insert(0, 'tests'); import hopper_compile; hopper_compile.install()\n"


def run_under_interpreter(script: str, *args: str, timeout: int = 900, hopper: bool = True) -> None:
    """Run `script` (python -c, with `args`) from the repository root with its Triton kernels interpreted on CPU;
    it must print ok. A fresh interpreter: the mode is chosen when triton is imported. hopper (the default): each
    launch is first compiled for sm_90 as on an H100 / H200 (tests/hopper_compile.py), so code that only the GPU
    compiler refuses fails here too; False: plain TRITON_INTERPRET=1 (a script that starts processes of its own)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if hopper:
        script = HOPPER_PRELUDE + script
    else:
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=timeout)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]

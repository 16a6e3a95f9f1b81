"""Real model geometries for `batchgen bench --model-geometry NAME`: random bf16 weights at the published shape of
each model (seed 0), and the decode floor each one has (the bytes a decode step must read).

The floor of a decode step is its weight bytes (less the embedding, whose rows are gathered) plus the K/V bytes
of every sequence's cached context, at the copy bandwidth measured in the run. Sliding-window layers (Gemma2,
Gemma3) read at most their window of K/V. Mixture-of-Experts models read only the experts the step's tokens
route to: `routed_weight_bytes` takes the distinct experts per layer counted from the router in the run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192},
                bos_token_id=128000, eos_token_id=128001)

# name -> (transformers model_type, config kwargs); shapes from each model's published config.json
GEOMETRIES: dict[str, tuple[str, dict]] = {
    "llama-8b": ("llama", LLAMA_8B),
    # bf16 (141 GB) does not fit one H200 beside a K/V cache: --weights fp8 (~71 GB), or tensor parallelism
    "llama-70b": ("llama", dict(LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                num_attention_heads=64, num_key_value_heads=8)),
    "mistral-7b": ("mistral", dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, rope_theta=1e6, sliding_window=None,
                                   max_position_embeddings=32768, tie_word_embeddings=False)),
    "qwen3-8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                               max_position_embeddings=40960, tie_word_embeddings=False)),
    "gemma2-9b": ("gemma2", dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                                 sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                 hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
                                 tie_word_embeddings=True)),
    "gemma3-12b": ("gemma3_text", dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                                       num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                       query_pre_attn_scalar=256, sliding_window=1024,
                                       hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
                                       tie_word_embeddings=True)),
    "gemma-7b": ("gemma", dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                               num_attention_heads=16, num_key_value_heads=16, head_dim=256,
                               hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
                               tie_word_embeddings=True)),
    "qwen2-7b": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                               num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6,
                               max_position_embeddings=32768, tie_word_embeddings=False)),
    "starcoder2-3b": ("starcoder2", dict(vocab_size=49152, hidden_size=3072, intermediate_size=12288,
                                         num_hidden_layers=30, num_attention_heads=24, num_key_value_heads=2,
                                         sliding_window=4096, rope_theta=999999.4420358813, use_bias=True,
                                         max_position_embeddings=16384, tie_word_embeddings=True,
                                         bos_token_id=0, eos_token_id=0)),
    # bigcode/starcoder2-7b's shape: the 3B's small GEMMs (E = 3,072) leave its W1 step latency-bound
    "starcoder2-7b": ("starcoder2", dict(vocab_size=49152, hidden_size=4608, intermediate_size=18432,
                                         num_hidden_layers=32, num_attention_heads=36, num_key_value_heads=4,
                                         sliding_window=4096, rope_theta=1e6, use_bias=True,
                                         max_position_embeddings=16384, tie_word_embeddings=True,
                                         bos_token_id=0, eos_token_id=0)),
    "phi3-mini": ("phi3", dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                               tie_word_embeddings=False)),
    "olmo2-7b": ("olmo2", dict(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                               tie_word_embeddings=False)),
    "granite-8b": ("granite", dict(vocab_size=49155, hidden_size=4096, intermediate_size=12800, num_hidden_layers=40,
                                   num_attention_heads=32, num_key_value_heads=8, embedding_multiplier=12.0,
                                   residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16.0,
                                   max_position_embeddings=4096, tie_word_embeddings=True)),
    # 128 experts of 768, top-8 renormalised; ~30.5B parameters, ~3.3B read per token
    "qwen3-30b-a3b": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                                        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)),
    "mixtral-8x7b": ("mixtral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, rope_theta=1e6, sliding_window=None,
                                     max_position_embeddings=32768, tie_word_embeddings=False)),
}


def model_config(name: str, **overrides):
    """The transformers config of geometry `name` (overrides: e.g. vocab_size of a real tokenizer)."""
    from transformers import AutoConfig

    if name not in GEOMETRIES:
        raise ValueError(f"--model-geometry {name!r}: one of {', '.join(GEOMETRIES)}")
    model_type, kwargs = GEOMETRIES[name]
    return AutoConfig.for_model(model_type, **{**kwargs, **overrides})


@dataclass(frozen=True)
class DecodeBytes:
    """What one decode step must read, by part, for a geometry."""

    dense_weight_bytes: int  # every weight a step reads whatever the routing (experts excluded), embedding excluded
    dense_params: int  # the parameters behind dense_weight_bytes (they differ from it / 2 with FP8 projections)
    expert_bytes: int  # one expert of one layer (0 for dense models)
    expert_params: int  # its parameters
    num_moe_layers: int
    num_experts: int  # experts per MoE layer
    kv_bytes_per_token: int  # one token's K and V in one layer
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window (None: the whole context)
    head_params: int = 0  # the LM head's parameters (in dense_params; never FP8)
    fp8_projections: bool = False  # the projections and experts are FP8 (their GEMMs run at the FP8 rate)

    def kv_bytes(self, context: int) -> int:
        """K/V bytes one sequence at `context` cached tokens reads in one step."""
        return self.kv_bytes_per_token * sum(min(context, w) if w else context for w in self.layer_windows)

    def kv_bytes_decoding(self, prompt: int, new: int) -> int:
        """K/V bytes one sequence reads over `new` decode steps after a `prompt`-token prefill (contexts prompt,
        prompt + 1, ..., prompt + new - 1), in closed form per window."""
        total = 0
        for window, layers in Counter(self.layer_windows).items():
            below = new if window is None else min(max(window - prompt, 0), new)  # steps before the window binds
            tokens = below * prompt + below * (below - 1) // 2 + (new - below) * (window or 0)
            total += layers * tokens
        return self.kv_bytes_per_token * total

    def active_params_per_token(self, experts_per_token: int) -> int:
        """Weights one token multiplies (prefill FLOPs / 2): the dense ones and its routed experts."""
        return self.dense_params + self.num_moe_layers * experts_per_token * self.expert_params

    def gemm_s(self, tokens: int, experts_per_token: int, ceilings, head: bool = True) -> float:
        """Seconds of `tokens` tokens' GEMM FLOPs (2 per weight a token multiplies) at the rates of `ceilings`
        (bench/seed.Ceilings): the projections and experts at the FP8 rate where they are FP8, the LM head at bf16's.
        head False: prompt tokens in a prefill, which skip the LM head (each generated token pays it)."""
        projections = self.active_params_per_token(experts_per_token) - self.head_params
        return ceilings.gemm_s(2 * projections * tokens, self.fp8_projections) + \
            (ceilings.gemm_s(2 * self.head_params * tokens) if head else 0.0)

    def weight_bytes(self, distinct_experts: int | None = None) -> int:
        """Weight bytes of a step whose tokens route to `distinct_experts` experts summed over the MoE layers
        (None: every expert, the bound when routing was not counted)."""
        experts = self.num_moe_layers * self.num_experts if distinct_experts is None else distinct_experts
        return self.dense_weight_bytes + experts * self.expert_bytes


PLAIN_MLP = {"starcoder2"}  # model types whose MLP is up -> activation -> down, without a gate


def decode_bytes(config, dtype_bytes: int = 2, projection_bytes: int | None = None,
                 kv_element_bytes: int | None = None) -> DecodeBytes:
    """The decode step's bytes for a transformers config (bf16 by default). MoE byte counts are moe_floor's.
    projection_bytes: bytes per weight of the layers' q/k/v/o and MLP projections (1: FP8 weights, `--weights fp8`;
    their fp32 scales, 4 bytes per 128x128 block or per row, are left out: < 0.1 %); the LM head, norms and K/V
    stay at dtype_bytes. None: 1 when the config is an FP8 checkpoint's (quant/scheme.py), else dtype_bytes.
    kv_element_bytes: bytes per cached key or value element (1: engine.kv_cache_dtype fp8; None: dtype_bytes)."""
    from batchgen.bench import moe_floor
    from batchgen.quant.scheme import is_fp8

    proj = projection_bytes or (1 if is_fp8(config) else dtype_bytes)

    cfg = config.get_text_config()
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    kv_heads = cfg.num_key_value_heads
    num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    if num_experts:
        dense = moe_floor.dense_step_bytes(cfg, dtype_bytes, proj)
        params = moe_floor.dense_step_bytes(cfg, 1)
        expert, moe_layers = moe_floor.expert_bytes(cfg, proj), sum(moe_floor.sparse_layers(cfg))
        expert_params = moe_floor.expert_bytes(cfg, 1)
    else:
        attention = hidden * head_dim * (2 * cfg.num_attention_heads + 2 * kv_heads)  # q, o, k, v
        head = cfg.vocab_size * hidden  # the LM head is read every step (tied or not)
        mlp_matrices = 2 if cfg.model_type in PLAIN_MLP else 3  # up + down, or gate + up + down
        projections = layers * (attention + mlp_matrices * hidden * cfg.intermediate_size)
        dense, params = projections * proj + head * dtype_bytes, projections + head
        expert, moe_layers, expert_params = 0, 0, 0
    window = getattr(cfg, "sliding_window", None)
    # no layer_types (Starcoder2, Mistral): a configured window holds for every layer
    types = getattr(cfg, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * layers
    windows = tuple(window if t == "sliding_attention" and window else None for t in types)
    return DecodeBytes(dense_weight_bytes=dense, dense_params=params, expert_bytes=expert, expert_params=expert_params,
                       num_moe_layers=moe_layers,
                       num_experts=num_experts,
                       kv_bytes_per_token=2 * kv_heads * head_dim * (kv_element_bytes or dtype_bytes),
                       layer_windows=windows, head_params=cfg.vocab_size * hidden, fp8_projections=proj == 1)

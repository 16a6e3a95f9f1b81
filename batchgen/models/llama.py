"""Fused decode forward of the Llama family (Llama, Mistral, Qwen2, Qwen3) over the transformers model's weights.

transformers' eager modules launch ~45 kernels per layer in a decode step, and cuBLAS runs the small q, k
and v projections far below the memory bandwidth (at 32 rows, a 1024x4096 bf16 GEMM reads its weight at
~0.3 TB/s on an H200, while one 6144x4096 GEMM reads q+k+v at ~2.1 TB/s). Per layer this runs 7 kernels:

    add+RMSNorm -> QKV GEMM -> rotary + K/V cache write + decode attention -> o GEMM
    -> add+RMSNorm -> gate/up GEMM -> SiLU*up -> down GEMM

(plus a merge kernel when the batch is too small for one attention split per (sequence, KV head), and a
separate rotary kernel for Qwen3, whose q/k RMSNorm runs there; quantised GEMMs' hand-offs: quant/fusion.py).
Prefill and mixed steps (`forward_packed`) run the same layers over every token, with the rotary + K/V write
kernel and the prefill attention kernel (decode kernel for the step's decode rows). On CPU, and wherever Triton
is absent, every kernel has a torch reference with the same rounding, so CI runs this exact code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.attention.backend import AttentionMetadata
from batchgen.attention.kv_cache import KVCache, KVGeometry
from batchgen.kernels.attention.rope_kv import QKNorm
from batchgen.models.base import DecodeForward
from batchgen.models.blocks import GatedMLP, Norm, PlainMLP, StepInputs, add_norm, mlp_input_quant, self_attention
from batchgen.quant.fusion import hand_offs, input_quant
from batchgen.quant.linear import InputQuant, LinearOutput, LinearWeight, linear_weight, make_linear, mixed_reason
from batchgen.models.shard import SHARD_ATTR, Shard, VocabParallelHead, local_geometry
from batchgen.models.weights import PaddedHead, fuse_linears

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this Llama-family model cannot use the fused decoder, or None when it can."""
    cfg = model.config.get_text_config()
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    return layout_reason(model, max_model_len)


def layout_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why a model with the Llama layer layout (pre-norm layers of q/k/v/o attention and a gated MLP) cannot
    run the fused layers, whatever its norm and activation: module layout, MLP biases, rope type. (Sliding
    windows are served: each layer passes its own to the kernels, see `LlamaDecoder._window`.)"""
    return module_reason(model) or rope_reason(model)


def module_reason(model: torch.nn.Module) -> str | None:
    """Why the model's modules are not the pre-norm layout the fused layers read (model.layers, lm_head, an
    input_layernorm with an eps, no MLP biases), or None."""
    cfg = model.config.get_text_config()
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} is not a causal LM with model.layers and lm_head"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    norm = getattr(inner.layers[0], "input_layernorm", None) if len(inner.layers) else None
    if norm is None or not (hasattr(norm, "variance_epsilon") or hasattr(norm, "eps")):
        return "layers without an RMSNorm input_layernorm (variance_epsilon or eps)"
    return fused_groups_reason(inner.layers)


def fused_groups_reason(layers) -> str | None:
    """Why projections the fused layers run as one GEMM (q/k/v, gate/up) cannot be joined: quantised and plain
    weights mixed, or different quantisation schemes (quant/modules.py), or None."""
    groups = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "q_proj"):
            groups.append([attn.q_proj, attn.k_proj, attn.v_proj])
        if hasattr(mlp, "gate_proj"):
            groups.append([mlp.gate_proj, mlp.up_proj])
    return mixed_reason(groups)


def rope_reason(model: torch.nn.Module) -> str | None:
    """Why the rotary embedding is not a static table of positions (the fused layers index it per token): a
    rope that depends on the sequence length, or one over part of the head only."""
    rotary = model.model.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        return f"rope type {rope_type!r} (depends on the sequence length)"
    return partial_rotary_reason(model)


def partial_rotary_reason(model: torch.nn.Module) -> str | None:
    """Why the rotary does not cover the whole head (the rotary kernels rotate all D dims), or None."""
    inv_freq = getattr(model.model.rotary_emb, "inv_freq", None)  # [D / 2] when it covers the head
    head_dim = KVGeometry.from_config(model.config).head_dim
    if inv_freq is not None and 2 * inv_freq.numel() != head_dim:
        return f"partial rotary ({2 * inv_freq.numel()} of {head_dim} head dims)"
    return None


def window_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why the attention is windowed within max_model_len (the Llama-family layers attend to the whole context;
    Gemma2/Gemma3 pass their windows to the kernels)."""
    cfg = model.config.get_text_config()
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    slides = window is not None and (layer_types is None or "sliding_attention" in layer_types)
    if getattr(cfg, "use_sliding_window", True) is False:  # Qwen2/Qwen3 configs carry a window they do not use
        slides = False
    if slides and window < max_model_len:
        return f"sliding window {window} < max_model_len {max_model_len}"
    return None


def norm_eps(norm: torch.nn.Module) -> float:
    """A norm module's epsilon (Llama-style modules call it variance_epsilon, Gemma's and LayerNorm eps)."""
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def qk_norm(attn: torch.nn.Module, unit_offset: bool = False) -> QKNorm:
    """An attention module's per-head q_norm / k_norm as one QKNorm: a [2, D] copy of the weights (the q row, then
    the k row) so one kernel pointer reaches both. `unit_offset`: Gemma3's (1 + w) rounding."""
    eps = norm_eps(attn.q_norm)
    if norm_eps(attn.k_norm) != eps:
        raise ValueError(f"q_norm eps {eps} != k_norm eps {norm_eps(attn.k_norm)}: the fused kernel takes one")
    return QKNorm(torch.stack([attn.q_norm.weight, attn.k_norm.weight]).detach().contiguous(), eps, unit_offset)


@dataclass
class Layer:
    """One pre-norm decoder layer's weights, views of the model's own (no copies)."""

    input_norm: Norm  # [E]
    qkv_weight: LinearWeight  # [(H + 2 Hkv) D, E]: the q rows, then k, then v (quantised: quant/linear.py)
    qkv_bias: torch.Tensor | None  # [(H + 2 Hkv) D] (Qwen2, Starcoder2)
    o_weight: LinearWeight  # [E, H D]
    o_bias: torch.Tensor | None  # [E]
    post_norm: Norm  # [E], before the MLP
    mlp: GatedMLP | PlainMLP
    scale: float  # the attention's softmax scale
    qk_norm: QKNorm | None  # Qwen3: per-head q/k RMSNorm
    sliding_window: int | None = None  # the keys a query sees on this layer (Mistral, Qwen2 sliding layers); None: all


class LlamaDecoder(DecodeForward):
    """The pre-norm layer loop, with hooks for what families change: how a module's weights are read
    (`_qkv`, `_mlp`, `_norm`), the embedding (`_embed`), the rotary tables (`_cos_sin`), a sublayer's output
    scaled before the residual add (`branch_scale`, inside the add + norm kernel) and the logits (`_logits`).
    Llama itself runs every hook as identity."""
    model_types = MODEL_TYPES
    unsupported_reason = staticmethod(unsupported_reason)
    supports_tensor_parallel = True
    supports_deterministic = True

    is_fused = True
    has_packed = True
    norm_kind = "rms"  # the RMSNorm rounding (blocks.Norm): Gemma "rms_unit_offset"
    activation = "silu"  # the MLP gate's activation (kernels/norm/gated_act.py)
    branch_scale: float | None = None  # each sublayer's output times this before the residual add (Granite)
    # quantised GEMMs' hand-offs to and from the norms / activation / attention (quant/fusion.py), with Triton
    gemm_hand_offs = True

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, use_triton: bool,
                 shard: Shard | None = None, deterministic: bool = False, fp8_gemm: str = "auto") -> None:
        self.config = model.config.get_text_config()
        self.kv_cache = kv_cache
        self.use_triton = use_triton
        self._set_gemms(deterministic, fp8_gemm, sharded=shard is not None)  # before the layers read them
        self._set_shard(model, shard)
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.lm_head = self._lm_head(model.lm_head)
        with torch.no_grad():
            self.final_norm = self._norm(inner.norm)
            self.layers = [self._layer(layer) for layer in inner.layers]

    def _set_gemms(self, deterministic: bool, fp8_gemm: str, sharded: bool) -> None:
        """The decoder's GEMM and its hand-offs (quant/). engine.deterministic: every GEMM (layers and LM head)
        batch-invariant, every row's attention through the per-query kernel; norms, rotary and activations are
        per row already (one program or element each). Else engine.fp8_gemm's path for quantised weights."""
        self.deterministic = deterministic
        self.name = "fused, batch-invariant" if deterministic else "fused"
        self.linear = make_linear(fp8_gemm, deterministic)
        # None: none (no Triton, deterministic, or a family that takes none)
        self.fusion = hand_offs(fp8_gemm, self.use_triton, deterministic, sharded) if self.gemm_hand_offs else None

    def _set_shard(self, model: torch.nn.Module, shard: Shard | None) -> None:
        """Tensor parallelism: the model's weights are this rank's shard (models/shard.py shard_model_), the
        geometry this rank's heads; shard None: the whole model."""
        self.shard = shard
        if shard is not None:
            assert getattr(model, SHARD_ATTR, None) == (shard.rank, shard.size), "the model is not this rank's shard"
        self.geometry = local_geometry(KVGeometry.from_config(self.config), shard)

    def _lm_head(self, head: torch.nn.Module):
        """The LM head the step calls: this rank's vocabulary rows with the logits gathered (a shard), the head
        padded to aligned rows (an odd vocabulary, outside engine.deterministic), or the module itself."""
        if self.shard is not None:
            return VocabParallelHead(head, self.shard)
        if not self.deterministic and PaddedHead.wanted(head):
            with torch.no_grad():
                return PaddedHead(head)
        return head

    # ---- weights: hooks ----------------------------------------------------------------------------------------

    def _layer(self, layer: torch.nn.Module) -> Layer:
        attn = layer.self_attn
        qkv_w, qkv_b = self._qkv(attn)
        return Layer(
            input_norm=self._norm(layer.input_layernorm), qkv_weight=qkv_w, qkv_bias=qkv_b,
            o_weight=linear_weight(attn.o_proj), o_bias=attn.o_proj.bias, post_norm=self._norm(layer.post_attention_layernorm),
            mlp=self._mlp(layer.mlp), scale=getattr(attn, "scaling", self.geometry.head_dim ** -0.5),
            # a [2, D] copy (the q row, then the k row) so one kernel pointer reaches both
            qk_norm=qk_norm(attn) if hasattr(attn, "q_norm") else None,
            sliding_window=self._window(attn))

    def _window(self, attn: torch.nn.Module) -> int | None:
        """The layer's sliding window as its transformers module applies it: Qwen-style modules keep their own
        (None on full-attention layers); Mistral-, Phi3-, Starcoder2- and Mixtral-style ones pass the config's
        to every layer."""
        if getattr(self.config, "use_sliding_window", True) is False:  # Qwen configs carry an unused window
            return None
        if hasattr(attn, "sliding_window"):
            return attn.sliding_window
        return getattr(self.config, "sliding_window", None)

    def _norm(self, module: torch.nn.Module) -> Norm:
        return Norm(module.weight, norm_eps(module), self.norm_kind)

    def _qkv(self, attn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused q/k/v weight [(H + 2 Hkv) D, E] and bias: the projections rebound as views into one tensor."""
        return fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])

    def _mlp(self, mlp: torch.nn.Module) -> GatedMLP | PlainMLP:
        gate_up_w, _ = fuse_linears([mlp.gate_proj, mlp.up_proj])
        return GatedMLP(gate_up_w, linear_weight(mlp.down_proj), self.activation, linear=self.linear,
                        fusion=self.fusion)

    # ---- the step: hooks ---------------------------------------------------------------------------------------

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start [B, E]: a fresh tensor (the layers update it in place)."""
        return self.embed(input_ids)

    def _cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos and sin [B, D] at each row's position, as transformers' rotary module makes them."""
        cos, sin = self.rotary(x, positions[None])  # [1, B, D] each
        return cos[0].contiguous(), sin[0].contiguous()

    def _next_norm(self, i: int, like: torch.Tensor) -> tuple[Norm, InputQuant | None]:
        """The norm after layer i (the next one's input norm, or the final norm) and its GEMM's input_quant."""
        if i + 1 < len(self.layers):
            return self.layers[i + 1].input_norm, input_quant(self.fusion, self.layers[i + 1].qkv_weight, like)
        return self.final_norm, None

    def _reduce(self, partial: LinearOutput) -> LinearOutput:
        """A row-parallel GEMM's output [B, E] summed over the tensor-parallel ranks (in place), before anything
        else reads it; the identity without a shard (the only case where it may be split-K partials)."""
        return partial if self.shard is None else self.shard.all_reduce(partial)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head's GEMM [S, E] -> [S, V] (batch-invariant in deterministic mode)."""
        if self.deterministic:
            return self.linear(h, self.lm_head.weight, self.lm_head.bias)
        return self.lm_head(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._head(h)  # [S, V]

    # ---- the step ----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int | None = None) -> torch.Tensor:
        h = self._hidden(input_ids, positions, lambda cos, sin: StepInputs(
            positions, slot_mapping, block_tables, seq_lens, cos, sin, self.use_triton, max_seq_len,
            invariant=self.deterministic, kv_lens=seq_lens if self.deterministic else None))
        return self._logits(h)  # [B, V]

    @torch.inference_mode()
    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       logits_index: torch.Tensor) -> torch.Tensor:
        invariant = {}
        if self.deterministic:  # each token a row of its own: its sequence, and the keys up to its position
            tokens = torch.arange(input_ids.shape[0], dtype=torch.int32, device=input_ids.device)  # [T]
            row_seq = torch.searchsorted(meta.query_start_loc[1:], tokens, right=True).to(torch.int32)  # [T]
            invariant = dict(invariant=True, kv_lens=(positions + 1).to(torch.int32), row_seq=row_seq)
        h = self._hidden(input_ids, positions, lambda cos, sin: StepInputs(
            positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, cos, sin, self.use_triton,
            meta.max_seq_len, packed=meta, **invariant))
        return self._logits(h[logits_index])  # [S, V]

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, make_step) -> torch.Tensor:
        """The final-normed hidden states [B, E] of every row; `make_step(cos, sin)` builds the StepInputs."""
        tri, geo = self.use_triton, self.geometry
        residual = self._embed(input_ids)  # [B, E]; updated in place below
        step = make_step(*self._cos_sin(residual, positions))
        h = add_norm(residual, self.layers[0].input_norm, None, tri,
                     quant=input_quant(self.fusion, self.layers[0].qkv_weight, residual))
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = self.kv_cache.layer(i)
            o = self_attention(h, layer.qkv_weight, layer.qkv_bias, layer.o_weight, layer.o_bias, k_cache, v_cache,
                               step, geo.num_heads, geo.num_kv_heads, layer.scale, layer.qk_norm,
                               sliding_window=layer.sliding_window, linear=self.linear, fusion=self.fusion)
            h = add_norm(self._reduce(o), layer.post_norm, residual, tri, x_scale=self.branch_scale,
                         quant=mlp_input_quant(layer.mlp, residual))
            mlp = layer.mlp(h, tri)
            norm, quant = self._next_norm(i, residual)
            h = add_norm(self._reduce(mlp), norm, residual, tri, x_scale=self.branch_scale, quant=quant)
        return h

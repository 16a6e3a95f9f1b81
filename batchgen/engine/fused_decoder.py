"""FusedDecoder: our own decode-step forward for Llama-family models, over the transformers model's weights.

transformers' eager modules launch ~45 kernels per layer in a decode step, and cuBLAS runs the small q, k
and v projections far below the memory bandwidth (at 32 rows, a 1024x4096 bf16 GEMM reads its weight at
~0.3 TB/s on an H200, while one 6144x4096 GEMM reads q+k+v at ~2.1 TB/s). Per layer this runs 7 kernels:

    add+RMSNorm -> QKV GEMM -> rotary + K/V cache write + decode attention -> o GEMM
    -> add+RMSNorm -> gate/up GEMM -> SiLU*up -> down GEMM

(plus a merge kernel when the batch is too small for one attention split per (sequence, KV head), and a
separate rotary kernel for Qwen3, whose q/k RMSNorm runs there).

The fused QKV and gate/up weights are the model's own memory: the q/k/v (gate/up) Linear weights are
rebound as views into one concatenated tensor, so the transformers forward (prefill and mixed steps) keeps
working on the same bytes and no weight is held twice.

Only decode steps (one new token per sequence) run here. On CPU, and wherever Triton is absent, every
kernel has a torch reference with the same rounding, so CI runs this exact code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.engine.kv_cache import KVCache
from batchgen.kernels.paged_attention_ref import paged_attention_ref
from batchgen.kernels.rmsnorm import rmsnorm
from batchgen.kernels.rope_kv import rope_kv
from batchgen.kernels.silu_mul import silu_mul

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this model cannot use the fused decoder, or None when it can."""
    cfg = model.config.get_text_config()
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {cfg.model_type!r} (fused decoder: {', '.join(SUPPORTED_MODEL_TYPES)})"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} is not a causal LM with model.layers and lm_head"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        return f"rope type {rope_type!r} (depends on the sequence length)"
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    slides = window is not None and (layer_types is None or "sliding_attention" in layer_types)
    if getattr(cfg, "use_sliding_window", True) is False:  # Qwen2/Qwen3 configs carry a window they do not use
        slides = False
    if slides and window < max_model_len:
        return f"sliding window {window} < max_model_len {max_model_len}"
    return None


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the Linears' weights (and biases) along the output dim; rebind each as a view into it.
    Idempotent: weights already laid out back to back in one tensor are reused, not copied again."""
    weights = [lin.weight for lin in linears]
    fused = _adjacent(weights)
    if fused is None:
        fused = torch.cat([w.detach() for w in weights])
        _rebind(linears, "weight", fused)
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return fused, None
    if any(b is None for b in biases):
        raise ValueError("cannot fuse projections where only some have a bias")
    fused_bias = _adjacent(biases)
    if fused_bias is None:
        fused_bias = torch.cat([b.detach() for b in biases])
        _rebind(linears, "bias", fused_bias)
    return fused, fused_bias


def _adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The single tensor these are consecutive row slices of, if they are; else None."""
    first = tensors[0]
    ptr, size = first.data_ptr(), first.element_size()
    for t in tensors:
        if t.data_ptr() != ptr or not t.is_contiguous() or t.untyped_storage().data_ptr() != \
                first.untyped_storage().data_ptr():
            return None
        ptr += t.numel() * size
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                            (rows, *first.shape[1:]))


def _rebind(linears: list[torch.nn.Linear], name: str, fused: torch.Tensor) -> None:
    start = 0
    for lin in linears:
        param = getattr(lin, name)
        rows = param.shape[0]
        param.data = fused[start:start + rows]
        start += rows


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    input_eps: float
    qkv_weight: torch.Tensor  # [(H + 2 Hkv) D, hidden]
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor  # [hidden, H D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    post_eps: float
    gate_up_weight: torch.Tensor  # [2 I, hidden]
    down_weight: torch.Tensor  # [hidden, I]
    scale: float
    qk_norm: tuple[torch.Tensor, float] | None  # Qwen3: per-head q/k RMSNorm weights [2, D] (q, k), eps


class FusedDecoder:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, use_triton: bool) -> None:
        cfg = model.config.get_text_config()
        inner = model.model
        self.kv_cache = kv_cache
        self.use_triton = use_triton
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.final_norm, self.final_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = model.lm_head
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                attn, mlp = layer.self_attn, layer.mlp
                qkv_w, qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
                gate_up_w, _ = _fuse([mlp.gate_proj, mlp.up_proj])
                self.layers.append(_Layer(
                    input_norm=layer.input_layernorm.weight, input_eps=layer.input_layernorm.variance_epsilon,
                    qkv_weight=qkv_w, qkv_bias=qkv_b, o_weight=attn.o_proj.weight, o_bias=attn.o_proj.bias,
                    post_norm=layer.post_attention_layernorm.weight,
                    post_eps=layer.post_attention_layernorm.variance_epsilon,
                    gate_up_weight=gate_up_w, down_weight=mlp.down_proj.weight,
                    scale=getattr(attn, "scaling", self.head_dim ** -0.5),
                    # a [2, D] copy (the q row, then the k row) so one kernel pointer reaches both
                    qk_norm=(torch.stack([attn.q_norm.weight, attn.k_norm.weight]).detach(),
                             attn.q_norm.variance_epsilon) if hasattr(attn, "q_norm") else None))

    def check(self) -> str | None:
        """Run one token through the decode forward (compiling its Triton kernels): None when it works, else
        why not. The token lives in the cache's trash block (never a real sequence's), at position 0."""
        dev = self.kv_cache.k_cache.device
        trash_block = self.kv_cache.num_blocks
        try:
            self(torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev),
                 torch.full((1,), self.kv_cache.trash_slot, dtype=torch.int64, device=dev),
                 torch.full((1, 1), trash_block, dtype=torch.int32, device=dev),
                 torch.ones(1, dtype=torch.int32, device=dev))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except Exception as e:  # a kernel that does not build or run on this device: fall back, say why
            return f"the fused decoder failed on {dev}: {type(e).__name__}: {str(e)[:200]}"
        return None

    def _attention_fn(self, block_tables: torch.Tensor, seq_lens: torch.Tensor):
        """attend(q, k_cache, v_cache, scale) -> [B, H, D] for this step; the CPU reference's metadata is
        built once per step, not once per layer."""
        if self.use_triton:
            from batchgen.kernels.paged_decode import paged_decode_attention

            return lambda q, k_cache, v_cache, scale: paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                                            seq_lens, scale)
        qsl = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        max_seq_len = int(seq_lens.max())
        return lambda q, k_cache, v_cache, scale: paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens,
                                                                     block_tables, 1, max_seq_len, scale)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """One decode token per sequence. input_ids, positions, slot_mapping: [B] int64; block_tables:
        [B, W] int32; seq_lens: [B] int32 (cache length after this step; 0 marks a padding row, whose
        slot must be the cache's trash slot). Returns logits [B, V]."""
        tri = self.use_triton
        if tri:
            from batchgen.kernels.paged_decode import paged_decode_rope_attention
        num_tokens = input_ids.shape[0]
        residual = self.embed(input_ids)  # [B, hidden]; a fresh tensor, updated in place below
        cos, sin = self.rotary(residual, positions[None])  # [1, B, D] each, in the activation dtype
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        attend = self._attention_fn(block_tables, seq_lens)
        first = self.layers[0]
        h = rmsnorm(residual, first.input_norm, first.input_eps, use_triton=tri)
        for i, layer in enumerate(self.layers):
            qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias)  # [B, (H + 2 Hkv) D]
            k_cache, v_cache = self.kv_cache.layer(i)
            if tri and layer.qk_norm is None:  # rotary and the K/V write inside the attention kernel
                attn = paged_decode_rope_attention(qkv, cos, sin, slot_mapping, k_cache, v_cache, block_tables,
                                                   seq_lens, layer.scale, self.num_heads)  # [B, H, D]
            else:
                q = rope_kv(qkv, cos, sin, slot_mapping, k_cache, v_cache, self.num_heads, self.num_kv_heads,
                            qk_norm=layer.qk_norm, use_triton=tri)  # [B, H, D]
                attn = attend(q, k_cache, v_cache, layer.scale)  # [B, H, D]
            o = F.linear(attn.reshape(num_tokens, -1), layer.o_weight, layer.o_bias)
            h = rmsnorm(o, layer.post_norm, layer.post_eps, residual=residual, use_triton=tri)
            mlp = F.linear(silu_mul(F.linear(h, layer.gate_up_weight), use_triton=tri), layer.down_weight)
            if i + 1 < len(self.layers):
                nxt = self.layers[i + 1]
                h = rmsnorm(mlp, nxt.input_norm, nxt.input_eps, residual=residual, use_triton=tri)
            else:
                h = rmsnorm(mlp, self.final_norm, self.final_eps, residual=residual, use_triton=tri)
        return self.lm_head(h)  # [B, V]

"""The one place that picks an attention kernel for a step: Triton decode, Triton ragged prefill, or the torch
reference (CPU). Both kernels serve sliding windows and soft-capping (Gemma2/Gemma3 layers).

Callers: transformers' attention hook (`interface.py`: prefill, mixed and non-fused decode steps), which
hands over the step's queries and new K/V (written into the paged cache here, before any sequence attends),
and the fused forwards of `models/` (decode steps, and packed steps through `attend_cached`: their rotary
kernel has already written the K/V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchgen.attention.kv_cache import KVCache
from batchgen.kernels.invariant.attention import query_attention_rows
from batchgen.kernels.attention.reference import paged_attention_ref, write_kv
from batchgen.kernels.attention.paged_prefill import paged_prefill_attention
from batchgen.kernels.attention.prefill_launch import PrefillWork
from batchgen.kernels.attention.rope_kv import QKNorm

if TYPE_CHECKING:  # FP8 hand-offs pass through decode_rope untouched: only quant/ builds or reads them
    from batchgen.kernels.fp8.quant import ActQuant, QuantizedActs
    from batchgen.kernels.fp8.splitk_common import SplitKPartials


@dataclass
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    use_triton: bool = False  # on CUDA the decode rows run the Triton kernel; the other rows the reference
    num_decode_seqs: int = 0  # the leading sequences with one new token each (the runner packs them first)
    prefill_work: PrefillWork | None = None  # the Triton prefill kernel's work items (all sequences) and launch


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, scale: float, use_triton: bool, max_seq_len: int | None = None,
           sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence over a cache that already holds it. q: [B, H, D]; caches: [N, bs, Hkv, D];
    block_tables: [B, W] int32; seq_lens: [B] int32. Returns [B, H, D]. `max_seq_len` (reference only):
    a bound on seq_lens known on the host; None reads it from seq_lens."""
    if use_triton:
        from batchgen.kernels.attention.paged_decode import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                      sliding_window=sliding_window, softcap=softcap)
    qsl = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    bound = max_seq_len if max_seq_len is not None else int(seq_lens.max())
    return paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, block_tables, 1, bound, scale,
                               sliding_window=sliding_window, softcap=softcap)


def attend_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     kv_lens: torch.Tensor, row_seq: torch.Tensor | None, scale: float, use_triton: bool,
                     sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """engine.deterministic: each row one query token over the keys already in the cache, in a summation order
    fixed by the token's position alone (kernels/invariant/attention.py), for decode and packed steps alike.
    q: [R, H, D]; kv_lens: [R] int32 (position + 1; 0: padding); row_seq: [R] int32 or None (row r is sequence
    r). Returns [R, H, D]."""
    if use_triton:
        from batchgen.kernels.invariant.attention import query_attention

        return query_attention(q, k_cache, v_cache, block_tables, kv_lens, row_seq, scale,
                               sliding_window=sliding_window, softcap=softcap)
    return query_attention_rows(q, k_cache, v_cache, block_tables, kv_lens, row_seq, scale,
                                sliding_window=sliding_window, softcap=softcap)


def decode_rope(qkv: torch.Tensor | SplitKPartials, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                scale: float, num_heads: int, sliding_window: int | None = None,
                softcap: float | None = None, qk_norm: QKNorm | None = None,
                quant: ActQuant | None = None) -> torch.Tensor | QuantizedActs:
    """Rotary embedding (after the per-head q/k RMSNorm `qk_norm`, if any: Qwen3, Gemma3), K/V cache write and
    decode attention in one Triton kernel (CUDA only; callers on CPU run `kernels.rope_kv.rope_kv` and `decode`).
    qkv: [B, (H + 2 Hkv) D] (or a split-K GEMM's partials); cos/sin: [B, D]. Returns [B, H, D], or with `quant`
    [B, H D] quantised where the kernel can (paged_decode_rope_attention)."""
    from batchgen.kernels.attention.paged_decode import paged_decode_rope_attention

    return paged_decode_rope_attention(qkv, cos, sin, slot_mapping, k_cache, v_cache, block_tables, seq_lens, scale,
                                       num_heads, sliding_window=sliding_window, softcap=softcap, qk_norm=qk_norm,
                                       quant=quant)


def attend(meta: AttentionMetadata, layer_idx: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
           scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """A packed step of any shape through transformers' modules. q: [T, H, D]; k_new/v_new: [T, Hkv, D].
    Returns [T, H, D]."""
    k_cache, v_cache = meta.kv_cache.layer(layer_idx)
    if meta.use_triton and meta.max_query_len == 1:
        # Decode-only step; a graph's metadata may be a larger static buffer: slice it to the step's tokens.
        n = q.shape[0]
        return torch.ops.batchgen.decode_attention(q, k_new, v_new, meta.slot_mapping[:n], meta.block_tables[:n],
                                                   meta.seq_lens[:n], meta.kv_cache.cache_id, layer_idx, scale,
                                                   sliding_window or 0, softcap or 0.0)
    write_kv(k_cache, v_cache, k_new, v_new, meta.slot_mapping)
    return attend_cached(meta, q, k_cache, v_cache, scale, sliding_window, softcap)


def attend_cached(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """A packed step whose new K/V are already in the cache (the fused forwards write them with the rotary).
    q: [T, H, D]. Returns [T, H, D]."""
    if meta.use_triton and meta.prefill_work is not None:
        # Decode rows (one token per sequence, packed first, one work item each) take the decode kernel;
        # every other row the prefill kernel, over its own sequence only.
        d = meta.num_decode_seqs
        out = paged_prefill_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                      meta.prefill_work.after(d), scale, sliding_window=sliding_window,
                                      softcap=softcap, out=torch.empty(q.shape, dtype=q.dtype, device=q.device))
        if d:
            out[:d] = decode(q[:d], k_cache, v_cache, meta.block_tables[:d], meta.seq_lens[:d], scale, True,
                             sliding_window=sliding_window, softcap=softcap)
        return out
    # CPU, and graphed steps through transformers' modules (no prefill work list): the torch reference.
    return paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                               meta.max_query_len, meta.max_seq_len, scale, sliding_window=sliding_window,
                               softcap=softcap)


@torch.library.custom_op("batchgen::decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, cache_id: int, layer_idx: int,
                     scale: float, sliding_window: int, softcap: float) -> torch.Tensor:
    """Write the step's K/V of layer `layer_idx` into the cache, then Triton decode attention (sliding_window
    0 and softcap 0.0: none). One opaque op for torch.compile; the cache is reached by id, so the compiler never
    sees (or copies) the mutation. Order is safe: the op's output feeds the next layer, so layers cannot be
    reordered around it."""
    k_cache, v_cache = KVCache.lookup(cache_id).layer(layer_idx)
    write_kv(k_cache, v_cache, key, value, slot_mapping)
    return decode(query, k_cache, v_cache, block_tables, seq_lens, scale, use_triton=True,
                  sliding_window=sliding_window or None, softcap=softcap or None)


@decode_attention.register_fake
def _decode_attention_fake(query, key, value, slot_mapping, block_tables, seq_lens, cache_id, layer_idx, scale,
                           sliding_window, softcap):
    return torch.empty_like(query)

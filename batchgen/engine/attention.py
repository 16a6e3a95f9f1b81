"""Our attention inside transformers models: registered in transformers' AttentionInterface, so any
decoder-only architecture transformers defines runs unchanged with the paged KV cache.

The model is called with one packed sequence of all scheduled tokens ([1, T]); each attention layer
writes its new K/V into the cache at `slot_mapping` and attends over each sequence's blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from batchgen.engine.kv_cache import KVCache
from batchgen.kernels.paged_attention_ref import paged_attention_ref, write_kv
from batchgen.kernels.paged_prefill import paged_prefill_attention

ATTENTION_NAME = "batchgen_paged"
METADATA_KWARG = "batchgen_attention"


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
    prefill_work: torch.Tensor | None = None  # [P, 2] int32 work items of the Triton prefill kernel, all sequences


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """query: [1, H, T, D]; key/value: [1, Hkv, T, D]. Returns ([1, T, H, D], None) as transformers expects."""
    meta: AttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' needs `{METADATA_KWARG}=` in the model call")
    k_cache, v_cache = meta.kv_cache.layer(module.layer_idx)
    q = query[0].transpose(0, 1)  # [T, H, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    sliding_window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    decode_ok = softcap is None and (sliding_window is None or sliding_window >= meta.max_seq_len)
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    if meta.use_triton and decode_ok and meta.max_query_len == 1:
        # Decode-only step; a graph's metadata may be a larger static buffer: slice it to the step's tokens.
        n = q.shape[0]
        out = torch.ops.batchgen.decode_attention(q, k_new, v_new, meta.slot_mapping[:n], meta.block_tables[:n],
                                                  meta.seq_lens[:n], meta.kv_cache.cache_id, module.layer_idx, scale)
        return out.unsqueeze(0), None
    if meta.use_triton and meta.prefill_work is not None:
        # Decode rows (one token per sequence, packed first, one work item each) take the decode kernel
        # where it applies; every other row the prefill kernel, over its own sequence only.
        d = meta.num_decode_seqs if decode_ok else 0
        write_kv(k_cache, v_cache, k_new[d:], v_new[d:], meta.slot_mapping[d:])
        out = paged_prefill_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                      meta.prefill_work[d:], scale, sliding_window=sliding_window, softcap=softcap,
                                      out=torch.empty(q.shape, dtype=q.dtype, device=q.device))
        if d:
            out[:d] = torch.ops.batchgen.decode_attention(
                q[:d], k_new[:d], v_new[:d], meta.slot_mapping[:d], meta.block_tables[:d], meta.seq_lens[:d],
                meta.kv_cache.cache_id, module.layer_idx, scale)
        return out.unsqueeze(0), None
    # CPU (and graphs of models the decode kernel cannot serve): the torch reference.
    write_kv(k_cache, v_cache, k_new, v_new, meta.slot_mapping)
    out = paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                              meta.max_query_len, meta.max_seq_len, scale,
                              sliding_window=sliding_window, softcap=softcap)
    return out.unsqueeze(0), None


@torch.library.custom_op("batchgen::decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, cache_id: int, layer_idx: int,
                     scale: float) -> torch.Tensor:
    """Write the step's K/V of layer `layer_idx` into the cache, then Triton decode attention. One opaque op
    for torch.compile; the cache is reached by id, so the compiler never sees (or copies) the mutation.
    Order is safe: the op's output feeds the next layer, so layers cannot be reordered around it."""
    from batchgen.kernels.paged_decode import paged_decode_attention

    k_cache, v_cache = KVCache.lookup(cache_id).layer(layer_idx)
    write_kv(k_cache, v_cache, key, value, slot_mapping)
    return paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)


@decode_attention.register_fake
def _decode_attention_fake(query, key, value, slot_mapping, block_tables, seq_lens, cache_id, layer_idx, scale):
    return torch.empty_like(query)


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@contextmanager
def paged_attention_enabled(model: torch.nn.Module) -> Iterator[None]:
    """Route the model's attention to ours for the duration (restores the caller's setting after)."""
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}.values()
    previous = [(c, c._attn_implementation) for c in configs]
    try:
        for c, _ in previous:
            c._attn_implementation = ATTENTION_NAME
        yield
    finally:
        for c, impl in previous:
            c._attn_implementation = impl

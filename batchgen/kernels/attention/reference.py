"""Torch reference for paged attention: write the step's K/V into the cache, attend over each sequence's blocks.

Runs on CPU and GPU; it is the ground truth the Triton kernels are tested against. It gathers each
sequence's K/V into a padded [B, max_seq_len] tensor, so it costs memory proportional to
batch x longest context: fine as a reference and on CPU, not a fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


KV_FP8 = torch.float8_e4m3fn  # engine.kv_cache_dtype: fp8 (scale 1: values past FP8_MAX saturate)
FP8_MAX = 448.0  # its largest finite value (kernels/attention/rope_kv.py's as_cached saturates there too)
FP16_MAX = 65504.0  # bf16 queries over an fp8 cache attend in fp16, clamped here (kernels: query_operand)


def as_cached(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it: an fp8 cache saturates at +-FP8_MAX, clamped here so that every device
    and kernel (kernels/attention/rope_kv.py's as_cached) rounds a value past it alike."""
    if dtype == KV_FP8:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(KV_FP8)
    return x.to(dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache/v_cache: [num_blocks, block_size, Hkv, D]; key/value: [T, Hkv, D]; slot_mapping: [T] int64."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    for cache, new in ((k_cache, key), (v_cache, value)):
        rows, new = cache.view(-1, num_kv_heads, head_dim), as_cached(new, cache.dtype)
        if cache.dtype == KV_FP8:  # torch has no fp8 index_copy_ on CPU: the same bytes as uint8
            rows, new = rows.view(torch.uint8), new.view(torch.uint8)
        rows.index_copy_(0, slot_mapping, new)


def paged_attention_ref(
    query: torch.Tensor,  # [T, H, D] packed queries of all sequences, in sequence order
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], already holding this step's keys
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [B] int32, tokens in the cache per sequence after this step
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, H, D]
    device = query.device
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]

    kv_pos = torch.arange(max_seq_len, device=device)  # [L]
    # Gather whole blocks (contiguous rows of block_size * Hkv * D), then cut to the longest sequence.
    num_blocks = -(-max_seq_len // block_size)
    table = block_tables[:, :num_blocks].reshape(-1).long()
    keys = k_cache.index_select(0, table).view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    values = v_cache.index_select(0, table).view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    keys, values = keys[:, :max_seq_len], values[:, :max_seq_len]  # [B, L, Hkv, D]

    q_start = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:].long() - q_start  # [B]
    q_off = torch.arange(max_query_len, device=device)  # [Q]
    q_valid = q_off[None, :] < q_lens[:, None]  # [B, Q]
    q_index = torch.where(q_valid, q_start[:, None] + q_off[None, :], 0)
    queries = query[q_index]  # [B, Q, H, D]
    q_pos = seq_lens.long()[:, None] - q_lens[:, None] + q_off[None, :]  # [B, Q] absolute positions

    # Padded query rows get q_pos >= seq_len, so they see every real key: no all-masked rows, no NaN.
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < seq_lens.long()[:, None, None])
    if sliding_window is not None:
        mask &= (q_pos[:, :, None] - kv_pos[None, None, :]) < sliding_window
    # GQA without copying K/V per query head: the G query heads sharing one KV head become G*Q query rows.
    group = num_heads // num_kv_heads
    q = queries.view(num_seqs, max_query_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * max_query_len, head_dim)  # [B, Hkv, G*Q, D]
    if k_cache.dtype == KV_FP8 and q.dtype == torch.bfloat16:  # in fp16, as the kernels (query_operand)
        q = q.float().clamp(-FP16_MAX, FP16_MAX).half()
    k = keys.transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    v = values.transpose(1, 2).to(q.dtype)
    mask = mask[:, None, None].expand(-1, -1, group, -1, -1).reshape(num_seqs, 1, group * max_query_len, max_seq_len)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)
    # [B, Hkv, G*Q, D] -> [B, Q, Hkv*G, D]
    out = out.view(num_seqs, num_kv_heads, group, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs, max_query_len, num_heads, head_dim)
    assert out.shape[0] == num_seqs
    return out[q_valid].to(query.dtype)  # [T, H, D]: row-major over (seq, offset) == packed order

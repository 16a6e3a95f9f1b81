"""Tensor parallelism over the fused decoders' weights (`shard_model_`, rank r of N): attention is split by heads,
rank r holding query heads [r H/N, (r+1) H/N) and KV heads [r Hkv/N, (r+1) Hkv/N) (GQA groups stay whole: query head
h reads KV head h // (H / Hkv) on every rank); q/k/v and gate/up are column-parallel (their output rows sliced),
o_proj and down row-parallel (their input columns sliced), so each layer needs one sum over ranks after o_proj and one
after down (`Shard.all_reduce`, called by the decoders); the LM head is split by vocabulary rows
(`VocabParallelHead` gathers the logits on every rank); embeddings and norms stay whole on every rank.
Mixture-of-experts layers split every expert the same way (`_experts_`): each rank holds a 1/N slice of every
expert's intermediate dimension (gate/up rows, down columns) and of the shared expert's, the router whole, so
every rank routes alike and the block's output is a partial sum, summed by the same all-reduce as a dense MLP's.
Also here: whether a model can be split N ways (`divisibility_reason`; a quantised checkpoint's scale blocks:
quant/scheme.py `split_reason`) and a KV geometry as one rank holds it (`local_geometry`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.quant.linear import column_tensors, experts_scale_tensors, row_tensors, sync_sizes


SHARD_ATTR = "_batchgen_shard"  # set on a model by shard_model_: (rank, size); its weights are that rank's


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` in a tensor-parallel group, with the two collectives a sharded forward calls. Built
    by batchgen.distributed (the models layer never imports it). Both return the same bytes on every rank: the
    ranks' activations stay identical after each collective, so every rank samples the same tokens."""

    rank: int
    size: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]  # sums x [B, E] over the ranks in place; returns x
    all_gather: Callable[[torch.Tensor], torch.Tensor]  # x [B, n] per rank -> [B, size n], rank order


def divisibility_reason(config, size: int) -> str | None:
    """Why a model of this config cannot be split `size` ways (heads, KV heads, MLP columns), or None. The
    vocabulary need not divide: the last rank's LM-head rows are padded."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                       ("intermediate_size", getattr(text, "intermediate_size", None)),
                       ("moe_intermediate_size", getattr(text, "moe_intermediate_size", None)),  # the experts'
                       ("shared_expert_intermediate_size", getattr(text, "shared_expert_intermediate_size", None))):
        if value is not None and value % size:
            return f"it does not divide the model's {key} ({value})"
    return None


def local_geometry(geometry, shard: Shard | None):
    """A KVGeometry as one rank holds it: H / N query heads and Hkv / N KV heads (head dim unchanged)."""
    if shard is None or shard.size == 1:
        return geometry
    return dataclasses.replace(geometry, num_heads=geometry.num_heads // shard.size,
                               num_kv_heads=geometry.num_kv_heads // shard.size)


def shard_model_(model: torch.nn.Module, rank: int, size: int, copy: bool = False) -> None:
    """Rebind the decoder layers' projections and the LM head to rank `rank`'s shard of `size`. Row slices
    (column-parallel q/k/v, gate/up, the LM head) are views of the loaded weights unless `copy`: a view keeps
    the whole tensor's storage alive, so a model already on the GPU passes copy=True (the loader shards on the
    CPU instead, and moving the model to the GPU then copies only the shards). Column slices (row-parallel
    o_proj, down) and checkpoint-fused q/k/v or gate/up are always copies (strided, or three parts joined).
    A row-parallel bias is added once, on rank 0 (the others drop it), before the sum over ranks.
    The modules no longer run transformers' forward; only a fused decoder built with the Shard reads them."""
    if getattr(model, SHARD_ATTR, None) is not None:
        raise ValueError(f"the model is already sharded as {getattr(model, SHARD_ATTR)}")
    cfg = model.config.get_text_config()
    reason = divisibility_reason(cfg, size)
    if reason is not None:
        raise ValueError(f"tensor_parallel_size {size}: {reason}")
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if hasattr(attn, "qkv_proj"):  # checkpoint-fused [q; k; v] (Phi-3): slice each part, join (a copy)
                _rows_(attn.qkv_proj, [(0, q_rows), (q_rows, kv_rows), (q_rows + kv_rows, kv_rows)], rank, size)
            else:
                for lin, rows in ((attn.q_proj, q_rows), (attn.k_proj, kv_rows), (attn.v_proj, kv_rows)):
                    _rows_(lin, [(0, rows)], rank, size, copy)
            _columns_(attn.o_proj, rank, size)
            for norm, rows in ((getattr(attn, "q_norm", None), q_rows), (getattr(attn, "k_norm", None), kv_rows)):
                if norm is not None and norm.weight.shape[0] == rows:  # over the whole projection (OLMo2), not
                    _rows_(norm, [(0, rows)], rank, size, copy)       # per head (Qwen3's [D]): the rank's heads'
            if hasattr(mlp, "experts"):  # a sparse MoE block: every expert split, the router whole
                _experts_(mlp.experts, rank, size)
                mlp = getattr(mlp, "shared_expert", None)  # Qwen2-MoE's, a gated MLP split as below
                if mlp is None:
                    continue
            if hasattr(mlp, "gate_up_proj"):  # checkpoint-fused [gate; up] (Phi-3): each half sliced, joined
                inter = mlp.gate_up_proj.weight.shape[0] // 2
                _rows_(mlp.gate_up_proj, [(0, inter), (inter, inter)], rank, size)
                _columns_(mlp.down_proj, rank, size)
            elif hasattr(mlp, "gate_proj"):
                _rows_(mlp.gate_proj, [(0, mlp.gate_proj.weight.shape[0])], rank, size, copy)
                _rows_(mlp.up_proj, [(0, mlp.up_proj.weight.shape[0])], rank, size, copy)
                _columns_(mlp.down_proj, rank, size)
            else:  # plain MLP (Starcoder2): c_fc column-parallel, c_proj row-parallel
                _rows_(mlp.c_fc, [(0, mlp.c_fc.weight.shape[0])], rank, size, copy)
                _columns_(mlp.c_proj, rank, size)
        _vocab_rows_(model.lm_head, rank, size, copy)
    setattr(model, SHARD_ATTR, (rank, size))


def _set(lin: torch.nn.Linear, name: str, value: torch.Tensor | None) -> None:
    setattr(lin, name, None if value is None else torch.nn.Parameter(value, requires_grad=False))


def _rows_(lin: torch.nn.Linear, parts: list[tuple[int, int]], rank: int, size: int, copy: bool = True) -> None:
    """Keep rank's 1/size of each (start, rows) part of the output rows (weight and bias; a quantised weight's
    scale rows too, quant/linear.py row_tensors). One part: a view unless `copy`; several: joined, a copy."""
    for name, per in row_tensors(lin):  # per: weight rows a row of the tensor covers
        t = getattr(lin, name, None)  # a norm (OLMo2's q/k) has no bias
        if t is None:
            continue
        pieces = [t[(start + rank * (rows // size)) // per:(start + (rank + 1) * (rows // size)) // per]
                  for start, rows in parts]
        joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        _set(lin, name, joined.clone() if copy and len(pieces) == 1 else joined)
    sync_sizes(lin)


def _experts_(experts: torch.nn.Module, rank: int, size: int) -> None:
    """Keep rank's 1/size of every expert's intermediate dimension I (transformers 5.x's 3-D parameters): of
    gate_up [E, 2 I, H] the rank's gate rows then its up rows (joined), of down [E, H, I] its columns; transposed
    layouts ([E, H, 2 I], [E, I, H]) on their own axes. Copies (contiguous), so the whole tensors can be freed."""
    transposed = getattr(experts, "is_transposed", False)
    axis = 2 if transposed else 1  # gate_up's 2 I axis (down's I axis: the other of 1 and 2)
    inter = experts.gate_up_proj.shape[axis] // 2
    part = inter // size
    # (name, axis, weight rows or columns per element along it): quantised experts' scales follow their blocks
    gate_up_scales, down_scales = experts_scale_tensors(experts)
    gate_ups = [("gate_up_proj", axis, 1)] + gate_up_scales
    downs = [("down_proj", 3 - axis, 1)] + down_scales
    for name, dim, per in gate_ups:
        t = getattr(experts, name)
        pieces = [t.narrow(dim, (start + rank * part) // per, part // per) for start in (0, inter)]
        _set(experts, name, torch.cat(pieces, dim=dim))
    for name, dim, per in downs:
        t = getattr(experts, name)
        _set(experts, name, t.narrow(dim, rank * part // per, part // per).clone(memory_format=torch.contiguous_format))
    if hasattr(experts, "intermediate_dim"):
        experts.intermediate_dim = part


def _columns_(lin: torch.nn.Linear, rank: int, size: int) -> None:
    """Keep rank's 1/size of the input columns (a contiguous copy: a column slice is strided; a quantised weight's
    block scales likewise, quant/linear.py column_tensors); the bias stays on rank 0 only (added once before the
    sum over ranks)."""
    cols = lin.weight.shape[1] // size
    for name, per in column_tensors(lin):  # per: weight columns a column of the tensor covers
        t = getattr(lin, name)
        _set(lin, name, t[:, rank * cols // per:(rank + 1) * cols // per].contiguous())
    sync_sizes(lin)
    if lin.bias is not None and rank != 0:
        _set(lin, "bias", None)


def _vocab_rows_(head: torch.nn.Linear, rank: int, size: int, copy: bool) -> None:
    """Keep rank's ceil(V / size) vocabulary rows; the last rank's are zero-padded when size does not divide V
    (a copy, its logits trimmed after the gather). A tied LM head is untied: the embedding stays whole."""
    vocab = head.weight.shape[0]
    per_rank = -(-vocab // size)
    start, end = rank * per_rank, min(vocab, (rank + 1) * per_rank)
    for name in ("weight", "bias"):
        t = getattr(head, name)
        if t is None:
            continue
        part = t[start:end]
        if end - start < per_rank:  # padding rows: zeros, never sampled (trimmed)
            part = torch.cat([part, part.new_zeros((per_rank - (end - start), *part.shape[1:]))])
        elif copy:
            part = part.clone()
        _set(head, name, part)
    head.vocab_size = vocab  # the unsharded row count, for VocabParallelHead's trim


class VocabParallelHead:
    """The LM head of a sharded model: this rank's vocabulary rows, then the logits of every rank gathered
    (in rank order) and trimmed to the true vocabulary. Every rank ends with the same full logits [B, V]."""

    def __init__(self, head: torch.nn.Linear, shard: Shard) -> None:
        self.weight = head.weight  # [ceil(V / N), E]
        self.bias = head.bias  # [ceil(V / N)] or None
        self.vocab_size = head.vocab_size
        self.shard = shard

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight, self.bias)  # [S, ceil(V / N)]
        full = self.shard.all_gather(local)  # [S, N ceil(V / N)]
        return full if full.shape[1] == self.vocab_size else full[:, :self.vocab_size].contiguous()  # [S, V]

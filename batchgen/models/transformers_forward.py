"""Decode steps through transformers' own modules, with our paged attention: any architecture transformers
defines, for models without a fused decoder (or with it turned off). Runs eagerly or inside the CUDA graphs."""

from __future__ import annotations

import torch

from batchgen.attention.interface import METADATA_KWARG, AttentionMetadata, paged_attention_enabled
from batchgen.attention.kv_cache import KVCache
from batchgen.models.base import DecodeForward


class TransformersDecode(DecodeForward):
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, use_triton: bool, max_model_len: int,
                 reason: str) -> None:
        self.name = f"transformers ({reason})"
        self.model = model
        self.kv_cache = kv_cache
        self.use_triton = use_triton
        self.max_model_len = max_model_len  # the attention bound inside graphs (no host value there)
        self._query_start_loc: torch.Tensor | None = None  # [Bmax + 1] int32 0..Bmax; one token per sequence

    def _qsl(self, num_seqs: int, device: torch.device) -> torch.Tensor:
        # Grown outside graph capture only: graphs capture their largest bucket first.
        if self._query_start_loc is None or self._query_start_loc.shape[0] < num_seqs + 1:
            self._query_start_loc = torch.arange(max(num_seqs, 256) + 1, dtype=torch.int32, device=device)
        return self._query_start_loc[:num_seqs + 1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int | None = None) -> torch.Tensor:
        n = input_ids.shape[0]
        meta = AttentionMetadata(
            kv_cache=self.kv_cache, slot_mapping=slot_mapping, query_start_loc=self._qsl(n, input_ids.device),
            seq_lens=seq_lens, block_tables=block_tables, max_query_len=1,
            max_seq_len=max_seq_len if max_seq_len is not None else self.max_model_len, use_triton=self.use_triton)
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                         **{METADATA_KWARG: meta})
        return out.logits[0]

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        with paged_attention_enabled(self.model):
            return self.forward(*args, **kwargs)

"""DecodeForward: what the runner and the CUDA graphs call for a decode step, whichever model family runs it.

A decode step has one new token per sequence. Inputs (device tensors): input_ids, positions, slot_mapping
[B] int64; block_tables [B, W] int32; seq_lens [B] int32 (the new token included; 0 marks a graph's padding
row, whose slot is the cache's trash slot). Output: logits [B, V]. `max_seq_len` is a host-known bound on
seq_lens (None inside graphs: the implementation uses a static bound or reads none).
"""

from __future__ import annotations

import torch

from batchgen.attention.backend import AttentionMetadata


class DecodeForward:
    name: str = "?"  # what the start-up line prints: "fused", or "transformers (<why not fused>)"
    is_fused: bool = False
    has_packed: bool = False  # implements forward_packed; otherwise prefill steps run transformers' modules
    # A fused family's registration (models/registry.py FAMILIES reads these): the transformers model types it
    # serves, and what it supports beyond a plain run: a Shard (tensor parallelism) and batch-invariant kernels
    model_types: tuple[str, ...] = ()
    supports_tensor_parallel: bool = False
    supports_deterministic: bool = False

    @staticmethod
    def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
        """Why this model (of one of `model_types`) cannot run this family's fused forward, or None."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int | None = None) -> torch.Tensor:
        """The step's computation alone: what a CUDA graph captures and torch.compile may compile."""
        raise NotImplementedError

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       logits_index: torch.Tensor) -> torch.Tensor:
        """A step of any shape (prefill chunks, with or without decodes packed first): input_ids, positions [T]
        int64; `meta` as transformers' attention hook gets it; logits_index [S] int64: the rows whose logits
        are wanted. Returns logits [S, V]. Only where `has_packed`."""
        raise NotImplementedError

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int | None = None) -> torch.Tensor:
        """An eager step (the graphs call `forward` inside their own set-up)."""
        return self.forward(input_ids, positions, slot_mapping, block_tables, seq_lens, max_seq_len)

    def check(self, kv_cache) -> str | None:
        """Run one token through the forward (compiling its kernels): None when it works, else why not. The
        token lives in the cache's trash block (never a real sequence's), at position 0."""
        dev = kv_cache.k_cache.device
        try:
            with torch.inference_mode():
                self(torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev),
                     torch.full((1,), kv_cache.trash_slot, dtype=torch.int64, device=dev),
                     torch.full((1, 1), kv_cache.num_blocks, dtype=torch.int32, device=dev),
                     torch.ones(1, dtype=torch.int32, device=dev), 1)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except Exception as e:  # a kernel that does not build or run on this device: fall back, say why
            return f"the {self.name} decoder failed on {dev}: {type(e).__name__}: {str(e)[:200]}"
        return None

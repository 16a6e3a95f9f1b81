"""Our attention inside transformers models: registered in transformers' AttentionInterface, so any
decoder-only architecture transformers defines runs unchanged with the paged KV cache.

The model is called with one packed sequence of all scheduled tokens ([1, T]) and `batchgen_attention=`
metadata; each attention layer hands its queries and new K/V to `backend.attend`, which writes the K/V into
the cache at `slot_mapping` and attends over each sequence's blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

from batchgen.attention import backend
from batchgen.attention.backend import AttentionMetadata

ATTENTION_NAME = "batchgen_paged"
METADATA_KWARG = "batchgen_attention"

__all__ = ["ATTENTION_NAME", "METADATA_KWARG", "AttentionMetadata", "paged_attention_enabled"]


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """query: [1, H, T, D]; key/value: [1, Hkv, T, D]. Returns ([1, T, H, D], None) as transformers expects."""
    meta: AttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' needs `{METADATA_KWARG}=` in the model call")
    q = query[0].transpose(0, 1)  # [T, H, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = backend.attend(meta, module.layer_idx, q, key[0].transpose(0, 1), value[0].transpose(0, 1), scale,
                         sliding_window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"))
    return out.unsqueeze(0), None


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

"""CUDA graphs for decode steps: one graph per batch-size bucket, captured largest first, all sharing one
memory pool (they never run at once). A decode step of n sequences replays the smallest bucket >= n;
rows n.. are padding: seq_len 0 (attention writes zeros), their K/V go to the cache's trash slot.

Static inputs live here; `replay` copies a step's values into them. Captured region: the whole decode
forward (the fused decoder, or transformers' model with Triton decode attention) and the greedy argmax
(Triton, `kernels/argmax.py`); other sampling runs after, eagerly, on the graph's logits.

The graphs are captured with cuBLASLt as torch's BLAS back end (`blas_library`): a graph records the GEMM
kernels chosen at capture, and at decode's skinny shapes (M <= 64 rows) cuBLASLt reads the 8B model's o_proj
weights at 4.4 TB/s where cuBLAS reaches 3.2 (and needs a split-K reduce kernel), down_proj at 3.8 vs 3.5, and
is equal elsewhere (bench/profile_decode.py, bench/RESULTS.md). The choice is process-global in torch, so it is
set only around the capture and restored after; eager steps keep torch's default.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from batchgen.engine.attention import METADATA_KWARG, AttentionMetadata, paged_attention_enabled
from batchgen.engine.fused_decoder import FusedDecoder
from batchgen.engine.kv_cache import KVCache
from batchgen.kernels import argmax


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


@contextlib.contextmanager
def preferred_blas(library: str | None):
    """torch's BLAS back end set to `library` ('cublas' or 'cublaslt') inside the block; None: unchanged."""
    if library is None:
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, max_batch: int, max_model_len: int,
                 compile_model: bool = False, fused: FusedDecoder | None = None,
                 blas_library: str | None = "cublaslt") -> None:
        self.model = model
        self.blas_library = blas_library
        self.fused = fused  # our fused decode forward, or None for transformers' forward
        self.compile_model = compile_model
        self.kv_cache = kv_cache
        self.buckets = bucket_sizes(max_batch)
        self.max_batch = max_batch
        dev = kv_cache.k_cache.device
        max_blocks = -(-max_model_len // kv_cache.block_size)
        self.input_ids = torch.zeros(1, max_batch, dtype=torch.int64, device=dev)  # [1, Bmax]
        self.position_ids = torch.zeros(1, max_batch, dtype=torch.int64, device=dev)  # [1, Bmax]
        self.slot_mapping = torch.full((max_batch,), kv_cache.trash_slot, dtype=torch.int64, device=dev)  # [Bmax]
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)  # [Bmax]
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=dev)  # [Bmax, blocks]
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)  # [Bmax + 1]
        self.max_model_len = max_model_len
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # [B, V] graph-owned output per bucket
        self._greedy: dict[int, torch.Tensor] = {}  # [B] int64 argmax per bucket
        self.pool = None
        # One metadata object over the full static buffers: attention slices it to the step's batch, so a
        # compiled forward sees the same object for every bucket (no recompilation per bucket).
        self.meta = AttentionMetadata(
            kv_cache=kv_cache, slot_mapping=self.slot_mapping, query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens, block_tables=self.block_tables, max_query_len=1, max_seq_len=max_model_len,
            use_triton=True)

    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the step (the part torch.compile may compile)."""
        if self.fused is not None:
            b = input_ids.shape[1]
            return self.fused(input_ids[0], position_ids[0], self.slot_mapping[:b], self.block_tables[:b],
                              self.seq_lens[:b])
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **{METADATA_KWARG: self.meta})
        return out.logits[0]

    @torch.inference_mode()
    def capture(self) -> None:
        forward = torch.compile(self._forward, dynamic=True) if self.compile_model else self._forward
        vocab_size = self.model.config.get_text_config().vocab_size
        reason = argmax.check(self.kv_cache.k_cache.device, vocab_size)
        if reason is not None:
            warnings.warn(f"batchgen: {reason}; decode graphs use torch.argmax", stacklevel=2)
        greedy = argmax.greedy_argmax if reason is None else argmax.argmax_ref
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), paged_attention_enabled(self.model), preferred_blas(self.blas_library):
            for b in sorted(self.buckets, reverse=True):  # largest first: later graphs fit in its pool
                ids, pos = self.input_ids[:, :b], self.position_ids[:, :b]
                greedy(forward(ids, pos))  # warm-up run: compilation, Triton JIT, cuBLAS handles, lazy init
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self._logits[b] = forward(ids, pos)
                    self._greedy[b] = greedy(self._logits[b])
                self._graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               seq_lens: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one decode step of n = len(input_ids) sequences from device tensors ([n] int64 ids, positions,
        slots; [n] int32 seq_lens; [n, W] int32 block tables); returns (logits [n, V], greedy ids [n]).
        The copies into the static inputs are queued on the current stream, before the replay."""
        n = input_ids.shape[0]
        b = self.bucket_for(n)
        width = block_tables.shape[1]
        self.input_ids[0, :n].copy_(input_ids)
        self.position_ids[0, :n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:b].fill_(self.kv_cache.trash_slot)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:b].zero_()
        self.block_tables[:n, :width].copy_(block_tables)
        self._graphs[b].replay()
        return self._logits[b][:n], self._greedy[b][:n]

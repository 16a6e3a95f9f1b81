"""CUDA graphs for decode steps: one graph per batch-size bucket (engine/sizing.graph_buckets), captured largest
first, all sharing one memory pool (they never run at once; its size, the largest bucket's live tensors, is
reserved beside the K/V cache by sizing.row_costs). A decode step of n sequences replays the smallest bucket >= n;
rows n.. are padding: seq_len 0 (attention writes zeros), their K/V go to the cache's trash slot.

Static inputs live here; `replay` copies a step's values into them. Captured region: the model's decode
forward (`models/registry.py` chose it: a fused decoder, or transformers' modules with Triton decode attention)
and the greedy argmax (Triton, `kernels/sample/argmax.py`); other sampling runs after, eagerly, on the graph's logits.

A graph records the GEMM kernels torch's BLAS back end chose at capture: `blas_library` (engine.graph_blas_library,
cuBLASLt by default: at decode's skinny shapes it reads the 8B model's o_proj weights at 4.4 TB/s where cuBLAS
reaches 3.2; bench/profile_decode.py) for every bucket, None for torch's default. The choice is process-global in
torch, so it is set only around each capture and restored after; eager steps keep torch's default.
engine.deterministic's GEMMs pin their own library around every call, captured or eager
(kernels/invariant/fixed_row_gemm.py; engine/config.py refuses a library other than theirs).
"""

from __future__ import annotations

import warnings

import torch

from batchgen.attention.interface import paged_attention_enabled
from batchgen.attention.kv_cache import KVCache
from batchgen.engine.sizing import graph_buckets
from batchgen.kernels.sample import argmax
from batchgen.kernels.invariant.fixed_row_gemm import preferred_blas
from batchgen.models.base import DecodeForward


bucket_sizes = graph_buckets  # 1, 2, 4, 8, by 16 to 512, by 32 above, and the largest (engine/sizing.py)


class DecodeGraphs:
    def __init__(self, decode_forward: DecodeForward, model: torch.nn.Module, kv_cache: KVCache, max_batch: int,
                 max_model_len: int, compile: bool = False, blas_library: str | None = "cublaslt") -> None:
        self.decode_forward = decode_forward
        self.model = model  # routed to our attention during capture (transformers' modules read its config)
        self.blas_library = blas_library
        self.compile = compile
        self.kv_cache = kv_cache
        self.buckets = bucket_sizes(max_batch)
        self.max_batch = max_batch
        dev = kv_cache.k_cache.device
        max_blocks = -(-max_model_len // kv_cache.block_size)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)  # [Bmax]
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)  # [Bmax]
        self.slot_mapping = torch.full((max_batch,), kv_cache.trash_slot, dtype=torch.int64, device=dev)  # [Bmax]
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)  # [Bmax]
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=dev)  # [Bmax, blocks]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # [B, V] graph-owned output per bucket
        self._greedy: dict[int, torch.Tensor] = {}  # [B] int64 argmax per bucket
        self.pool = None

    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def _forward(self, b: int) -> torch.Tensor:
        """Logits [b, V] of a step over the first b rows of the static inputs."""
        return self.decode_forward.forward(self.input_ids[:b], self.positions[:b], self.slot_mapping[:b],
                                           self.block_tables[:b], self.seq_lens[:b])

    @torch.inference_mode()
    def capture(self) -> None:
        forward = torch.compile(self._forward, dynamic=True) if self.compile else self._forward
        vocab_size = self.model.config.get_text_config().vocab_size
        reason = argmax.check(self.kv_cache.k_cache.device, vocab_size)
        if reason is not None:
            warnings.warn(f"batchgen: {reason}; decode graphs use torch.argmax", stacklevel=2)
        greedy = argmax.greedy_argmax if reason is None else argmax.argmax_ref
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), paged_attention_enabled(self.model):
            for b in sorted(self.buckets, reverse=True):  # largest first: later graphs fit in its pool
                with preferred_blas(self.blas_library):
                    greedy(forward(b))  # warm-up run: compilation, Triton JIT, cuBLAS handles, lazy init
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        self._logits[b] = forward(b)
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
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:b].fill_(self.kv_cache.trash_slot)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:b].zero_()
        self.block_tables[:n, :width].copy_(block_tables)
        self._graphs[b].replay()
        return self._logits[b][:n], self._greedy[b][:n]

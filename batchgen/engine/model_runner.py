"""ModelRunner: turns a ScheduledBatch into tensors, runs the packed forward pass, samples on the device.

Only the last position of each sampling sequence goes through the LM head (`logits_to_keep`), and
only token ids come back to the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.attention import METADATA_KWARG, AttentionMetadata, paged_attention_enabled
from batchgen.engine.batch import ScheduledBatch
from batchgen.engine.fused_decoder import FusedDecoder, unsupported_reason
from batchgen.engine.kv_cache import KVCache
from batchgen.engine.sampler import SamplingTensors, sample


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class InFlight:
    """A dispatched step: its sampled ids on the device and (once `done`) in host memory."""

    tokens_gpu: torch.Tensor  # [S] int64, also the carry-over source of the next step
    tokens_host: torch.Tensor  # [S] int64, pinned on CUDA
    done: torch.cuda.Event | None  # recorded after the copy back; None on CPU (already there)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    logits_indices: torch.Tensor  # [S] int64: packed index of each sampling sequence's last token
    attention: AttentionMetadata
    sampling: SamplingTensors | None  # None when every sampling row is plain greedy (or none samples)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device,
                 cuda_graphs: bool = False, max_graph_batch: int = 256, max_model_len: int = 8192,
                 compile_model: bool = False, fused_decoder: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.vocab_size = model.config.get_text_config().vocab_size
        self.prepare_s = 0.0  # CPU time building step inputs
        self.use_triton = device.type == "cuda" and _triton_available()
        self._last_tokens: torch.Tensor | None = None  # [S] sampled ids of the latest dispatched step
        self._d2h_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Decode steps run our fused forward where the architecture has one (compile asks for transformers'
        # forward under torch.compile instead); prefill and mixed steps always run transformers' forward.
        self.fused = None
        reason = "off" if not fused_decoder else "compile requested" if compile_model else \
            unsupported_reason(model, max_model_len)
        if reason is None:
            self.fused = FusedDecoder(model, kv_cache, self.use_triton)
        self.decode_forward = "fused" if self.fused is not None else f"transformers ({reason})"
        self.graphs = None
        if cuda_graphs and self.use_triton:
            from batchgen.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, kv_cache, max_graph_batch, max_model_len, compile_model, self.fused)
            self.graphs.capture()

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        return self._to_device(*self._host_arrays(batch), batch)

    def _host_arrays(self, batch: ScheduledBatch):
        """The step's index math on the host (numpy): the same for the eager and the graph path."""
        seqs = batch.seqs
        bs = self.block_size
        q_lens = np.fromiter((s.num_new_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        seq_lens = np.fromiter((s.seq_len for s in seqs), dtype=np.int64, count=len(seqs))
        query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        max_blocks = max(len(s.block_table) for s in seqs)
        block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        for i, s in enumerate(seqs):
            block_tables[i, : len(s.block_table)] = s.block_table
        input_ids = np.fromiter((t for s in seqs for t in s.input_token_ids), dtype=np.int64,
                                count=int(query_start_loc[-1]))
        # positions: start_pos .. seq_len - 1 of each sequence, packed
        seq_of_token = np.repeat(np.arange(len(seqs)), q_lens)
        positions = np.arange(len(input_ids)) - query_start_loc[:-1][seq_of_token] + (seq_lens - q_lens)[seq_of_token]
        slot_mapping = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        return input_ids, positions, slot_mapping, q_lens, seq_lens, query_start_loc, block_tables

    def _sampling(self, batch: ScheduledBatch, seq_lens: np.ndarray) -> SamplingTensors | None:
        """The sampler's device inputs, or None when every sampling row is plain greedy (argmax is enough,
        and no host-to-device copy is needed)."""
        rows = [(s.sampling, int(seq_lens[i])) for i, s in enumerate(batch.seqs) if s.sampling is not None]
        if all(r.temperature == 0 and r.repetition_penalty == 1.0 and not r.suppressed_token_ids for r, _ in rows):
            return None
        return SamplingTensors.build([r for r, _ in rows], [p for _, p in rows], self.vocab_size, self.device)

    def _to_device(self, input_ids, positions, slot_mapping, q_lens, seq_lens, query_start_loc, block_tables,
                   batch: ScheduledBatch) -> StepInputs:
        seqs = batch.seqs
        sampled = [i for i, s in enumerate(seqs) if s.sampling is not None]
        logits_indices = query_start_loc[1:][sampled] - 1
        sampling = self._sampling(batch, seq_lens)

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        attention = AttentionMetadata(
            kv_cache=self.kv_cache, slot_mapping=dev(slot_mapping),
            query_start_loc=dev(query_start_loc.astype(np.int32)), seq_lens=dev(seq_lens.astype(np.int32)),
            block_tables=dev(block_tables), max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()),
            use_triton=self.use_triton,
        )
        return StepInputs(input_ids=dev(input_ids)[None], position_ids=dev(positions)[None],
                          logits_indices=dev(logits_indices), attention=attention, sampling=sampling)

    @torch.inference_mode()
    def dispatch(self, batch: ScheduledBatch) -> InFlight:
        """Queue one step on the device and return at once (on CUDA); `collect` gives its sampled tokens.
        Placeholders (`carry_from`) are filled on the device from the previous dispatch's sampled tokens."""
        t0 = time.perf_counter()
        host = self._host_arrays(batch)
        carry = self._carry(batch, host[5])
        if self.graphs is not None and batch.num_prefill_tokens == 0 and self.graphs.bucket_for(len(batch.seqs)):
            input_ids, positions, slot_mapping, _, seq_lens, _, block_tables = host
            sampling = self._sampling(batch, seq_lens)
            self.prepare_s += time.perf_counter() - t0
            logits, greedy = self.graphs.replay(input_ids, positions, slot_mapping, seq_lens, block_tables, carry)
            # clone: the graph's buffer is rewritten by the next replay
            tokens = greedy.clone() if sampling is None else sample(logits, sampling)
            return self._start_copy_back(tokens)
        inputs = self._to_device(*host, batch)
        if carry is not None:
            positions_gpu, sources_gpu, prev = carry
            inputs.input_ids[0, positions_gpu] = prev[sources_gpu]
        self.prepare_s += time.perf_counter() - t0
        if self.fused is not None and batch.num_prefill_tokens == 0:  # one token per sequence, all sample
            a = inputs.attention
            logits = self.fused(inputs.input_ids[0], inputs.position_ids[0], a.slot_mapping, a.block_tables,
                                a.seq_lens)  # [S, V]
        else:
            with paged_attention_enabled(self.model):
                out = self.model(input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                                 logits_to_keep=inputs.logits_indices, use_cache=False,
                                 **{METADATA_KWARG: inputs.attention})
            logits = out.logits[0]  # [S, V]: only the sampling rows went through the LM head
        tokens = logits.argmax(dim=-1) if inputs.sampling is None else sample(logits, inputs.sampling)
        return self._start_copy_back(tokens)

    def _carry(self, batch: ScheduledBatch, query_start_loc: np.ndarray):
        """(packed positions [K], source rows [K], previous step's tokens) for placeholders, or None."""
        rows = [(int(query_start_loc[i + 1]) - 1, s.carry_from) for i, s in enumerate(batch.seqs)
                if s.carry_from is not None]
        if not rows:
            return None
        prev = self._last_tokens
        assert prev is not None and max(src for _, src in rows) < prev.shape[0], "carry-over without its step"
        pos, src = zip(*rows)
        return (torch.tensor(pos, dtype=torch.int64).to(self.device, non_blocking=True),
                torch.tensor(src, dtype=torch.int64).to(self.device, non_blocking=True), prev)

    def _start_copy_back(self, tokens: torch.Tensor) -> InFlight:
        """Copy the sampled ids to pinned host memory on the copy stream; only that copy is ever waited on."""
        self._last_tokens = tokens
        if self.device.type != "cuda":
            return InFlight(tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h_stream):
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        tokens.record_stream(self._d2h_stream)  # keep its memory alive until the copy is done
        return InFlight(tokens, host, done)

    def collect(self, step: InFlight) -> list[int]:
        """Block until the step's tokens are on the host (the only wait on the device)."""
        if step.done is not None:
            step.done.synchronize()
        return step.tokens_host.tolist()

    def execute(self, batch: ScheduledBatch) -> list[int]:
        """Run one step synchronously: one sampled token per sequence with `sampling`, in batch order."""
        return self.collect(self.dispatch(batch))

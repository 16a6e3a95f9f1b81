"""ModelRunner: turns a ScheduledBatch into tensors, runs the packed forward pass, samples on the device.

Only the last position of each sampling sequence goes through the LM head (`logits_to_keep`), plus, for a
sequence that asks for prompt log-probs, the chunk positions that score its prompt; only token ids (and the
log-probs asked for, sample/logprobs.py) come back to the host. On CUDA three non-default streams carry a
step: its inputs go through pinned A/B staging on an H2D stream (staging.py), the forward and the sampler run on
the compute stream, the sampled ids come back on a D2H stream into pinned A/B slots; the host waits only for that
last copy.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from batchgen.attention.interface import METADATA_KWARG, AttentionMetadata, paged_attention_enabled
from batchgen.attention.kv_cache import KVCache
from batchgen.engine.batch import ScheduledBatch, StepOutput
from batchgen.kernels.attention.prefill_launch import PrefillWork
from batchgen.models.registry import build_decode_forward
from batchgen.runner.device_step import DeferredStep, DeviceStep, InFlight
from batchgen.runner.staging import StepStaging
from batchgen.runner.step_arrays import StepArrays
from batchgen.runner.step_timing import BusyWindow, StepTiming
from batchgen.sample import logprobs as lpmod
from batchgen.sample.grammar_mask import bitmask_words
from batchgen.sample.penalty import PenaltyTable
from batchgen.sample.sampler import SamplingTensors, sample


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device,
                 cuda_graphs: bool = False, max_graph_batch: int = 256, max_model_len: int = 8192,
                 compile: bool = False, fused_decoder: bool = True,
                 blas_library: str | None = "cublaslt", *, max_num_seqs: int, tensor_parallel=None,
                 deterministic: bool = False, fp8_gemm: str = "auto") -> None:
        self.model = model
        # distributed.TensorParallelGroup or None: every rank runs this runner over its shard; rank 0 sends each
        # step's plan to the others first (distributed/plan.py) and, on close, STOP
        self.tensor_parallel = tensor_parallel
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        # the activations' element size, as the K/V cache's but at least 2 bytes (an fp8 cache under bf16 queries)
        self._act_bytes = max(2, kv_cache.k_cache.element_size())
        self.vocab_size = model.config.get_text_config().vocab_size
        self.prepare_s = 0.0  # CPU time building step inputs
        self.timing = StepTiming()  # device time of collected steps by kind, and the idle time before them (CUDA)
        self.use_triton = device.type == "cuda" and _triton_available()
        self.penalties = PenaltyTable(max_num_seqs, self.vocab_size, device)  # rows: the scheduler's slots
        self._last_tokens: torch.Tensor | None = None  # [S] sampled ids of the latest dispatched step
        # Three non-default streams on CUDA: H2D (inside `staging`), compute, D2H. None on CPU.
        cuda = device.type == "cuda"
        self.compute_stream = torch.cuda.Stream(device) if cuda else None
        self._d2h_stream = torch.cuda.Stream(device) if cuda else None
        self.staging = StepStaging(device, self.compute_stream)
        self._out_host = [torch.empty(256, dtype=torch.int64, pin_memory=True) for _ in range(2)] if cuda else []
        self._out_next = 0
        # structured output: host bitmasks [G, ceil(V / 32)] int32, pinned A/B on CUDA. A slot is
        # refilled two steps later, after the host collected the step between, whose D2H copy follows this
        # slot's H2D copy on the compute stream: the copy out of it is done by then.
        self._bitmask_host: list[torch.Tensor] = []
        self._bitmask_next = 0
        # Decode steps (one token per sequence) run the model family's decode forward, replayed from CUDA
        # graphs where they are on; prefill and mixed steps run its packed forward where the family has one,
        # else transformers' forward with our attention.
        self.decode_forward = build_decode_forward(model, kv_cache, self.use_triton, max_model_len,
                                                   fused_decoder=fused_decoder, compile=compile,
                                                   shard=tensor_parallel.shard() if tensor_parallel else None,
                                                   deterministic=deterministic, fp8_gemm=fp8_gemm)
        self.graphs = None
        if cuda_graphs and self.use_triton:
            from batchgen.runner.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.decode_forward, model, kv_cache, max_graph_batch, max_model_len, compile,
                                       blas_library)
            self.graphs.capture()

    def close(self) -> None:
        """Drop the graphs (and their pool), the staging slots and the decode forward's own tensors."""
        if self.tensor_parallel is not None and self.tensor_parallel.is_leader:
            self.tensor_parallel.plans.send_stop()  # the other ranks' follow() returns
        if self.compute_stream is not None:
            torch.cuda.synchronize(self.device)
        self.graphs = None
        self.decode_forward = None
        self._last_tokens = None
        self._out_host = []
        self.staging = None
        self.penalties.close()

    def _sampling(self, batch: ScheduledBatch) -> SamplingTensors | None:
        """The sampler's device inputs, or None when every sampling row is plain greedy (argmax is enough,
        and nothing needs copying)."""
        rows = [s.sampling for s in batch.seqs if s.sampling is not None]
        if not SamplingTensors.needed(rows):
            return None
        positions = [s.seq_len for s in batch.seqs if s.sampling is not None]
        return SamplingTensors.build(rows, positions, self.vocab_size, self.device,
                                     to_device=self.staging.to_device, penalty_table=self.penalties)

    def _carry_rows(self, batch: ScheduledBatch, last_index: np.ndarray) -> list[np.ndarray]:
        """[packed positions [K], source rows [K]] of the placeholders to fill from the previous step's
        tokens, or [] when there are none."""
        rows = [(int(last_index[i]), s.carry_from) for i, s in enumerate(batch.seqs) if s.carry_from is not None]
        if not rows:
            return []
        prev = self._last_tokens
        assert prev is not None and max(src for _, src in rows) < prev.shape[0], "carry-over without its step"
        return [np.array([p for p, _ in rows], dtype=np.int64), np.array([s for _, s in rows], dtype=np.int64)]

    @torch.inference_mode()
    def dispatch(self, batch: ScheduledBatch, bitmask: torch.Tensor | None = None) -> InFlight | DeferredStep:
        """Queue one step on the device and return at once (on CUDA); `collect` gives its sampled tokens.
        Placeholders (`carry_from`) are filled on the device from the previous dispatch's sampled tokens.
        A batch with constrained rows needs their `bitmask` (from `bitmask_buffer`); without it the forward
        is queued and a DeferredStep returned, for `sample_deferred` to finish."""
        if self.tensor_parallel is not None and self.tensor_parallel.is_leader:
            self.tensor_parallel.plans.send_step(batch)  # first: the other ranks prepare it while this one does
        if self.compute_stream is None:
            return self._dispatch(batch, bitmask)
        # Whatever the caller queued on its own stream (weights, a cache reset) comes before this step.
        self.compute_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.compute_stream):
            return self._dispatch(batch, bitmask)

    # structured output
    def bitmask_buffer(self, num_rows: int) -> torch.Tensor:
        """A host int32 [num_rows, ceil(V / 32)] buffer for a step's bitmasks (pinned on CUDA), to fill and pass
        to `dispatch` / `sample_deferred` of that step; contents undefined."""
        width = bitmask_words(self.vocab_size)
        if self.compute_stream is None:
            return torch.empty(num_rows, width, dtype=torch.int32)
        if not self._bitmask_host or self._bitmask_host[0].shape[0] < num_rows:
            self._bitmask_host = [torch.empty(max(num_rows, 64), width, dtype=torch.int32, pin_memory=True)
                                  for _ in range(2)]
        host = self._bitmask_host[self._bitmask_next][:num_rows]
        self._bitmask_next ^= 1
        return host

    @torch.inference_mode()
    def sample_deferred(self, step: DeferredStep, bitmask: torch.Tensor) -> InFlight:
        """Queue the masked sampling (and the rest) of a deferred step; `collect` gives its tokens."""
        if self.compute_stream is None:
            return self._sample(step, bitmask)
        with torch.cuda.stream(self.compute_stream):
            return self._sample(step, bitmask)

    def _dispatch(self, batch: ScheduledBatch, bitmask: torch.Tensor | None = None) -> InFlight | DeferredStep:
        t0 = time.perf_counter()
        a = StepArrays.build(batch, self.block_size)
        carry = self._carry_rows(batch, a.last_index)
        decode_only = batch.num_prefill_tokens == 0  # one token per sequence, and every sequence samples
        graphed = self.graphs is not None and decode_only and self.graphs.bucket_for(len(batch.seqs)) is not None
        step = DeviceStep.stage(batch, a, carry, self.use_triton and not graphed, self.kv_cache.geometry.head_dim,
                                self._act_bytes, self.staging.begin_step, self.staging.to_device)
        # its start recorded before the first work this step queues on the compute stream
        busy = self.timing.dispatched(batch.num_prefill_tokens, self.compute_stream is not None)
        sampling = self._sampling(batch)
        self.prepare_s += time.perf_counter() - t0
        if step.carry:  # placeholders take the previous step's sampled tokens, on the device
            step.input_ids[step.carry[0]] = self._last_tokens[step.carry[1]]
        num_sampled = step.num_sampled
        if graphed:
            assert step.lp_inputs is None or step.lp_inputs.prompt_positions is None, "a decode step scores no prompt"
            logits, greedy = self.graphs.replay(step.input_ids, step.positions, step.slot_mapping, step.seq_lens,
                                                step.block_tables)
            # clone: the graph's buffer is rewritten by the next replay
            tokens = greedy.clone() if sampling is None else None if batch.num_constrained else \
                sample(logits, sampling, self.use_triton)
        else:
            logits = self._forward(step, decode_only)
            sample_logits = logits[:num_sampled]
            tokens = None if batch.num_constrained else sample_logits.argmax(dim=-1) if sampling is None else \
                sample(sample_logits, sampling, self.use_triton)
        if batch.num_constrained:  # structured output: sampled below, from the masked logits
            deferred = DeferredStep(logits, sampling, num_sampled, step.forced, step.lp_inputs, busy)
            return deferred if bitmask is None else self._sample(deferred, bitmask)
        return self._finish_step(tokens, logits, num_sampled, sampling, step.forced, step.lp_inputs, busy)

    def _forward(self, step: DeviceStep, decode_only: bool) -> torch.Tensor:
        """The eager forward of a step: the LM head's rows [K, V] (`step.keep`'s; a decode step: every sequence's
        last token, in batch order)."""
        a = step.arrays
        if decode_only:  # one token per sequence, all sample, in batch order
            return self.decode_forward(step.input_ids, step.positions, step.slot_mapping, step.block_tables,
                                       step.seq_lens, int(a.seq_lens.max()))
        attention = AttentionMetadata(
            kv_cache=self.kv_cache, slot_mapping=step.slot_mapping, query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens, block_tables=step.block_tables, max_query_len=step.max_query_len,
            max_seq_len=int(a.seq_lens.max()), use_triton=self.use_triton, num_decode_seqs=a.num_decode_seqs,
            prefill_work=None if step.prefill_work is None else PrefillWork(step.prefill_work, step.launch))
        if self.decode_forward.has_packed:  # the fused layers, with the prefill attention kernel
            return self.decode_forward.forward_packed(step.input_ids, step.positions, attention, step.keep)
        with paged_attention_enabled(self.model):
            out = self.model(input_ids=step.input_ids[None], position_ids=step.positions[None],
                             logits_to_keep=step.keep, use_cache=False, **{METADATA_KWARG: attention})
        return out.logits[0]  # [S + P, V]: the `keep` rows only, sampling rows in batch order

    def _sample(self, step: DeferredStep, bitmask: torch.Tensor) -> InFlight:
        """Structured output: the masked draw of a step with constrained rows, then the rest."""
        step.sampling.grammar_bitmask = bitmask.to(self.device, non_blocking=True)  # pinned -> no host wait
        tokens = sample(step.logits[:step.num_sampled], step.sampling, self.use_triton)
        return self._finish_step(tokens, step.logits, step.num_sampled, step.sampling, step.forced, step.lp_inputs,
                                 step.busy)

    def _finish_step(self, tokens: torch.Tensor, logits: torch.Tensor, num_sampled: int,
                     sampling: SamplingTensors | None, forced_d: torch.Tensor | None,
                     lp_inputs: lpmod.LogprobInputs | None, busy: BusyWindow | None) -> InFlight:
        """After the draw: forced tokens, log-probs, penalty marks, then the copy back."""
        if forced_d is not None:  # thinking budget: the end marker replaces whatever was drawn
            tokens = torch.where(forced_d >= 0, forced_d, tokens)
        lp_result = None
        if lp_inputs is not None:  # from the raw logits, after the draw: the final tokens' log-probs
            lp_result = lpmod.compute(logits[:num_sampled], tokens, logits[num_sampled:], lp_inputs)
        if sampling is not None and sampling.penalty is not None:  # the next step's penalty sees these tokens
            self.penalties.record(sampling.penalty_slot, tokens)
        self.staging.end_step()
        if busy is not None:
            busy.end.record()
        return self._start_copy_back(tokens, lp_result, busy)

    def _start_copy_back(self, tokens: torch.Tensor, lp_result: lpmod.LogprobResult | None,
                         busy: BusyWindow | None = None) -> InFlight:
        """Copy the sampled ids into a pinned host slot on the D2H stream; only that copy is ever waited on.
        Hazard: slots alternate, so at most two dispatched steps may be uncollected at any time (the engine
        keeps one in flight)."""
        self._last_tokens = tokens
        lp_device = lp_result.tensors() if lp_result is not None else None
        if self.compute_stream is None:
            return InFlight(tokens, tokens, None, lp_device)
        n = tokens.shape[0]
        if n > self._out_host[0].numel():
            self._out_host = [torch.empty(2 * n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        host = self._out_host[self._out_next][:n]
        self._out_next ^= 1
        self._d2h_stream.wait_stream(self.compute_stream)
        with torch.cuda.stream(self._d2h_stream):
            host.copy_(tokens, non_blocking=True)
            lp_host = None
            if lp_device is not None:  # rare (rows asked): fresh pinned buffers from torch's host cache
                lp_host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in lp_device.items()}
                for k, v in lp_device.items():
                    lp_host[k].copy_(v, non_blocking=True)
                    v.record_stream(self._d2h_stream)
            done = torch.cuda.Event()
            done.record()
        tokens.record_stream(self._d2h_stream)  # keep its memory alive until the copy is done
        return InFlight(tokens, host, done, lp_host, busy)

    def collect(self, step: InFlight) -> StepOutput:
        """Block until the step's tokens are on the host (the only wait on the device)."""
        if step.done is not None:
            step.done.synchronize()
        self.timing.collected(step.busy)  # both events are complete: the copy back came after them
        if step.logprobs_host is None:
            return StepOutput(token_ids=step.tokens_host.tolist())
        # copies: requests keep row views of these arrays until they finish (engine/scheduler.py), which must not
        # pin a fresh pinned buffer per step for the whole run. Hazard: were lp_host ever reused like _out_host's
        # A/B slots, views without this copy would be overwritten two steps later.
        arrays = {k: v.numpy().copy() for k, v in step.logprobs_host.items()}
        return StepOutput(token_ids=step.tokens_host.tolist(), **arrays)

    def execute(self, batch: ScheduledBatch, bitmask: torch.Tensor | None = None) -> StepOutput:
        """Run one step synchronously: one sampled token per sequence with `sampling`, in batch order
        (`bitmask`: the constrained rows' bitmasks, needed when the batch has any)."""
        return self.collect(self.dispatch(batch, bitmask))

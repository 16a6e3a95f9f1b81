"""Engine: the public face of the engine, and the only module of `engine/` that sees both the pure-Python side
(scheduler, block manager, requests) and the torch side (KV cache, model runner, sampler).

Three ways in: `generate(prompts, sampling)` for a list of raw prompts, `chat(conversations, sampling)` for
lists of {role, content} messages through the tokenizer's chat template, or the streaming interface the job
runner uses (`add_request`, `step`, finished results as they come).

Lifetime: `close()` (or leaving `with Engine(...) as engine:`) gives the KV cache, the CUDA graphs and their
pool, and the staging buffers back at once; an engine built by `from_pretrained` also drops its model.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import torch

from batchgen.attention.kv_cache import KVCache, KVGeometry, cache_dtype, plan_num_blocks
from batchgen.distributed.groups import for_engine, local_kv_geometry
from batchgen.engine.batch import ScheduledBatch, StepOutput
from batchgen.engine.block_manager import BlockManager
from batchgen.engine import sizing
from batchgen.engine.config import Auto, EngineConfig, check_chat_template_kwargs
from batchgen.engine.detokenizer import StopStringWatcher, final_text, text_token_ids
from batchgen.engine.reasoning import ReasoningMarkers, ThinkingBudget
from batchgen.engine.request import FinishReason, Request
from batchgen.engine.results import PromptResult, Sample, top_logprob_arrays
from batchgen.engine.scheduler import Scheduler
from batchgen.runner.model_runner import ModelRunner
from batchgen.sample.grammar import GrammarCache
from batchgen.sampling_params import SamplingParams
from batchgen.seeding import derive_seed


def _eos_ids(model, tokenizer) -> frozenset[int]:
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()


# Finished requests become results (their text detokenized) at most this many a step, or an eighth of those
# waiting if more, while the device has work: rows finishing together (a wave of equal lengths) are handed out
# over several steps instead of one host stall the device waits out
MIN_RESULTS_PER_STEP = 16

# Decode steps of up to this many sequences replay CUDA graphs (engine/sizing.graph_buckets): auto's largest
# batch; each bucket costs a capture at start-up, and all share one memory pool (counted in sizing.row_costs).
MAX_GRAPH_BATCH = sizing.MAX_AUTO_SEQS


class StepMarks(NamedTuple):
    """Host clock (time.perf_counter) marks of one async `Engine.step` call, for job/idle_trace.py."""

    entered: float
    scheduled: float  # the scheduler chose this step's batch
    dispatched: float  # its work is queued on the device (inputs built, forward and draw launched)
    collected: float  # the previous step's tokens are on the host (waiting for them)
    applied: float  # and applied to the requests (the scheduler's update)
    returned: float  # structured output's masked draw queued, finished requests made results (detokenized)
    step_index: int | None  # the dispatched step's index (runner/step_timing.py), None when none was


def _setting(value: int) -> int | None:
    """A size the user set, or None for auto."""
    return None if isinstance(value, Auto) else int(value)


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer=None, config: EngineConfig | None = None, *,
                 tensor_parallel=None) -> None:
        self.config = config = config or EngineConfig()
        self._closed = False
        self._owns_model = False  # from_pretrained: the model is the engine's to drop on close
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_model_len = config.context_length(model.config)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        # think markers for SamplingParams.thinking_budget: the tokenizer's <think> / </think> when it has them;
        # the job runner sets its output.reasoning markers here
        self.reasoning_markers: ReasoningMarkers | None = ReasoningMarkers.auto(tokenizer)
        # tensor parallelism (engine.tensor_parallel_size > 1): this rank's shard of the model (sharded here if the
        # loader did not) and of the KV cache (its KV heads); every rank builds an Engine, only rank 0 schedules
        self.tensor_parallel = tp = for_engine(model, config, tensor_parallel)
        geometry = local_kv_geometry(KVGeometry.from_config(model.config), tp)
        kv_dtype = cache_dtype(config.kv_cache_dtype, next(model.parameters()).dtype, self.device)
        cap, costs = self._capacity(geometry, kv_dtype)
        self.capacity = cap
        self.batch_size: sizing.BatchSize | None = None  # chosen at the first step with queued prompts
        self._build_cache(geometry, kv_dtype, costs.reserve_bytes(cap.max_num_seqs, cap.max_num_batched_tokens))
        self.scheduler = Scheduler(self.block_manager, cap.max_num_seqs, cap.max_num_batched_tokens)
        self.async_pipeline = config.async_on(self.device.type)
        self.runner = self._build_runner()
        self._decode_path = "fused" if self.runner.decode_forward.is_fused else "transformers"
        self._ids = itertools.count()
        self._pending: dict[str, tuple[PromptResult, SamplingParams, int]] = {}  # request id -> open samples
        self._finished: deque[Request] = deque()  # finished requests not yet made results (_collect), oldest first
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.schedule_s = 0.0  # CPU time in the scheduler (admission, eviction, block tables, updates)
        self._in_flight = None  # async pipeline: (batch, InFlight) dispatched and not yet applied
        self.host_marks: StepMarks | None = None  # the latest async step's host clock marks
        # structured output: compiled response formats (built by the first request with one), and
        # the host's time advancing matchers' masks into bitmasks
        self._grammars: GrammarCache | None = None
        self.grammar_s = 0.0
        if tp is not None and tp.is_leader:
            tp.plans.engine_built()  # the build's collectives are behind every rank: a STOP now reaches them

    def _capacity(self, geometry: KVGeometry, kv_dtype: torch.dtype) -> tuple[sizing.Capacity, sizing.RowCosts]:
        """The batch the engine's buffers are built for (engine.max_num_seqs / max_num_batched_tokens, or auto),
        and what each row of it costs besides the KV cache: activations of the largest step, and per sequence
        slot the sampler's [S, V] buffers and the decode graphs' pool. Auto on CUDA: as many slots as the memory
        left beside the cache allows (sizing.capacity)."""
        config, model, tp = self.config, self.model, self.tensor_parallel
        graphs = config.cuda_graphs and self.device.type == "cuda"
        costs = sizing.row_costs(model.config.get_text_config(),
                                 (geometry.num_heads + 2 * geometry.num_kv_heads) * geometry.head_dim,
                                 next(model.parameters()).element_size(), -(-self.max_model_len // config.block_size),
                                 graphs)
        sized = isinstance(config.max_num_seqs, Auto) and self.device.type == "cuda"  # by the memory left
        budget = geometry.bytes_per_block(config.block_size, kv_dtype) * plan_num_blocks(
            geometry, config.block_size, kv_dtype, self.device, config.gpu_memory_utilization, reserve_bytes=0,
            cpu_max_bytes=config.cpu_kv_cache_bytes) if sized else 0
        cap = sizing.capacity(self.device.type == "cuda", _setting(config.max_num_seqs),
                              _setting(config.max_num_batched_tokens), budget, costs)
        if tp is not None and cap.auto_seqs:  # every rank builds the same graph buckets and tables
            cap = dataclasses.replace(cap, max_num_seqs=tp.agree_min(cap.max_num_seqs))
        return cap, costs

    def _build_cache(self, geometry: KVGeometry, kv_dtype: torch.dtype, reserve_bytes: int) -> None:
        """The KV cache, of engine.num_kv_blocks blocks or as many as fit beside `reserve_bytes`, and its block
        manager."""
        config, tp = self.config, self.tensor_parallel
        num_blocks = config.num_kv_blocks or plan_num_blocks(
            geometry, config.block_size, kv_dtype, self.device, config.gpu_memory_utilization,
            reserve_bytes=reserve_bytes, cpu_max_bytes=config.cpu_kv_cache_bytes)
        if tp is not None:  # one block table serves every rank: the blocks that fit on all of them
            num_blocks = tp.agree_min(num_blocks)
        self.kv_cache = KVCache(geometry, num_blocks, config.block_size, kv_dtype, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)

    def _build_runner(self) -> ModelRunner:
        """The model runner over the cache (its decode forward, CUDA graphs up to the batch's size)."""
        config, cap = self.config, self.capacity
        try:
            return ModelRunner(self.model, self.kv_cache, self.device, cuda_graphs=config.cuda_graphs,
                               max_graph_batch=min(cap.max_num_seqs, MAX_GRAPH_BATCH),
                               max_model_len=self.max_model_len,
                               compile=config.compile, fused_decoder=config.fused_decoder,
                               blas_library=config.graph_blas_library, max_num_seqs=cap.max_num_seqs,
                               tensor_parallel=self.tensor_parallel, deterministic=config.deterministic,
                               fp8_gemm=config.fp8_gemm)
        except BaseException:
            self.kv_cache.release()  # a failed start (out of memory in graph capture) gives the cache back
            raise

    @classmethod
    def from_pretrained(cls, path: str, gguf_file: str | None = None, dtype: str = "auto", device: str = "auto",
                        config: EngineConfig | None = None) -> Engine:
        from batchgen.runner.loader import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(path, gguf_file=gguf_file, dtype=dtype, device=device)
        engine = cls(model, tokenizer, config)
        engine._owns_model = True
        return engine

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Give back the KV cache, the CUDA graphs and their pool and the staging buffers (and the model, if
        `from_pretrained` loaded it). Requests in flight are dropped. Idempotent; the engine is unusable after."""
        if self._closed:
            return
        self._closed = True
        self._in_flight = None
        self._pending.clear()
        self._finished.clear()
        self.runner.close()
        self.kv_cache.release()
        if self._owns_model:
            self.model = None
        if self.device.type == "cuda":
            # cuBLAS keeps a workspace (32 MiB on Hopper) per stream it ran on, ours included, in torch's
            # allocator; drop them all (they come back lazily for whoever runs a GEMM next)
            if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine is closed")

    # ---- streaming interface -------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, sample_seeds: Sequence[int] | None = None) -> str:
        """Queue one prompt (params.n samples). `sample_seeds` overrides the seeds derived from params.seed."""
        self._check_open()
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs an engine built with a tokenizer")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        params.check_vocab(self.runner.vocab_size)
        seeds = list(sample_seeds) if sample_seeds is not None else [
            params.seed if i == 0 else derive_seed(params.seed, i) for i in range(params.n)]
        if len(seeds) != params.n:
            raise ValueError(f"{len(seeds)} sample seeds for n={params.n}")
        thinking = self._thinking_budget(params)
        grammars = self._grammar_states(params)  # structured output (ValueError: a bad format)
        reqs = [Request(
            request_id=f"{request_id}#{i}", prompt_id=request_id, prompt_token_ids=prompt_ids, params=params,
            seed=seeds[i],
            eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len, sample_idx=i,
            stop_watcher=StopStringWatcher(self.tokenizer, params.stop) if params.stop and self.tokenizer else None,
            thinking=ThinkingBudget(thinking, params.thinking_budget, prompt_ids) if thinking else None,
            grammar=grammars[i] if grammars else None,
        ) for i in range(params.n)]
        reqs[0].followers = reqs[1:]
        self._pending[request_id] = (PromptResult(request_id, prompt_ids), params, params.n)
        self.scheduler.add(reqs[0])
        return request_id

    def _thinking_budget(self, params: SamplingParams) -> ReasoningMarkers | None:
        """The markers a thinking budget runs on; ValueError naming the key when there are none usable."""
        if params.thinking_budget is None:
            return None
        markers = self.reasoning_markers
        if markers is None:
            raise ValueError("sampling.thinking_budget needs think markers: the tokenizer has no <think> / "
                             "</think> tokens (a job can name them in output.reasoning)")
        if len(markers.end_ids) != 1:
            raise ValueError(f"sampling.thinking_budget needs an end marker of one token; it encodes to "
                             f"{len(markers.end_ids)} tokens {list(markers.end_ids)}")
        return markers

    # structured output
    def _grammar_states(self, params: SamplingParams) -> list | None:
        """One matcher per sample of a constrained prompt (compiling its format on first use), else None.
        A row ends where its grammar may end on one of its own stop tokens: EOS (unless ignore_eos) and
        stop_token_ids."""
        rf = params.response_format
        if rf is None:
            return None
        if self.tokenizer is None:
            raise ValueError("sampling.response_format needs an engine built with a tokenizer")
        if self.tensor_parallel is not None:  # the matchers and masks live on rank 0 only; the others sample too
            raise ValueError("sampling.response_format is not supported with engine.tensor_parallel_size > 1 yet")
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        stops = (() if params.ignore_eos else tuple(self.eos_token_ids)) + params.stop_token_ids
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        text_stops = [t for t in params.stop_token_ids if t not in special]
        return [self._grammars.state(rf, stops, text_stops) for _ in range(params.n)]

    def _bitmask(self, batch: ScheduledBatch):
        """The step's constrained rows' bitmasks (runner.bitmask_buffer), filled from their matchers now.
        Invariant: each matcher has accepted its row's every token but the one this step samples."""
        t0 = time.perf_counter()
        states = [s.sampling.grammar for s in batch.seqs if s.sampling is not None and s.sampling.grammar is not None]
        bitmask = self.runner.bitmask_buffer(len(states))
        self._grammars.fill(states, bitmask)
        self.grammar_s += time.perf_counter() - t0
        return bitmask

    @property
    def decode_path(self) -> str:
        """"fused" when batchgen's fused forward runs the model's steps, "transformers" when transformers' modules
        do (with our attention); `runner.decode_forward.name` adds the reason of a fallback. Fixed at start-up
        (and still readable after close(), which drops the runner's forward)."""
        return self._decode_path

    @property
    def has_unfinished(self) -> bool:
        return bool(self._pending)

    @property
    def num_unfinished_prompts(self) -> int:
        return len(self._pending)

    def stats(self) -> dict[str, float | int]:
        """Live counters for throughput logs."""
        s = self.scheduler
        return {"num_running": len(s.running), "num_waiting": len(s.waiting),
                "kv_cache_usage": round(self.block_manager.usage, 4), "num_kv_blocks": self.block_manager.num_blocks,
                "num_preemptions": s.num_preemptions, "prefix_hit_tokens": self.block_manager.num_prefix_hit_tokens,
                "num_steps": self.num_steps, "num_generated_tokens": self.num_generated_tokens,
                "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
                "schedule_cpu_s": round(self.schedule_s, 3), "grammar_cpu_s": round(self.grammar_s, 3),
                "prepare_cpu_s": round(self.runner.prepare_s, 3),
                # device time of the steps (CUDA), and by kind of step with the device's idle time before them
                "gpu_busy_s": round(self.runner.timing.gpu_busy_s, 3), **self.runner.timing.stats()}

    def take_idle_gaps(self) -> list[tuple[int, str, float]]:
        """The device's idle gaps over 1 ms before steps collected since the last call (CUDA): (step index, kind,
        seconds)."""
        return self.runner.timing.take_gaps()

    def step(self) -> list[PromptResult]:
        """Run one forward step; return the prompts whose samples are now all finished."""
        self._check_open()
        if self.batch_size is None and self.scheduler.waiting:
            self._choose_batch_size()
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t_scheduled = time.perf_counter()
        self.schedule_s += t_scheduled - t0
        if (not batch and self._pending and self._in_flight is None and not self._finished
                and not self.scheduler.has_work and not self.scheduler.has_finished):
            # nothing runs, waits, is in flight or is finished and unreported, yet prompts are unfinished: a bug
            # (stepping on would spin forever)
            raise RuntimeError(f"batchgen engine stuck: {len(self._pending)} prompt(s) unfinished (e.g. "
                               f"{next(iter(self._pending))!r}) with nothing left to schedule; please report this "
                               f"with the job file. Rows already returned are kept; a resumed run redoes the rest")
        if not self.async_pipeline:
            if batch:
                self._apply(batch, self.runner.execute(batch, self._bitmask(batch) if batch.num_constrained else None))
            return self._collect(self.scheduler.take_finished())
        # Async: queue this step, then wait for the previous one, whose tokens this step's placeholders take
        # on the device. The host prepares step N+1 while the device runs step N.
        step = self.runner.dispatch(batch) if batch else None
        t_dispatched = t_collected = time.perf_counter()
        if self._in_flight is not None:
            prev_batch, prev_step = self._in_flight
            output = self.runner.collect(prev_step)
            t_collected = time.perf_counter()
            self._apply(prev_batch, output)
        t_applied = time.perf_counter()
        if batch and batch.num_constrained:  # the masks need the tokens just applied (sample/grammar.py)
            step = self.runner.sample_deferred(step, self._bitmask(batch))
        self._in_flight = (batch, step) if batch else None
        results = self._collect(self.scheduler.take_finished())
        self.host_marks = StepMarks(t0, t_scheduled, t_dispatched, t_collected, t_applied, time.perf_counter(),
                                    self.runner.timing.num_dispatched if batch else None)
        return results

    def _choose_batch_size(self) -> None:
        """The run's batch within `capacity`, from the queued sequences' lengths (up to 4,096 requests' worth);
        an auto choice is said on stderr."""
        seq_tokens = [r.max_num_tokens for r in itertools.islice(self.scheduler.waiting, 4096)
                      for _ in range(1 + len(r.followers))]
        graphs = self.runner.graphs
        self.batch_size = size = sizing.choose(self.capacity, self.block_manager.num_blocks * self.config.block_size,
                                               seq_tokens, self.max_model_len, graphs.max_batch if graphs else None)
        self.scheduler.max_num_seqs, self.scheduler.max_num_batched_tokens = size.max_num_seqs, \
            size.max_num_batched_tokens
        if self.capacity.auto_seqs or self.capacity.auto_tokens:
            print(f"batchgen: {size.describe()}", file=sys.stderr)

    @property
    def max_num_seqs(self) -> int:
        """Sequences a step may hold: the choice once made, else the capacity."""
        return self.scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens

    def _apply(self, batch: ScheduledBatch, output: StepOutput) -> None:
        t0 = time.perf_counter()
        self.scheduler.update(batch, output)
        self.schedule_s += time.perf_counter() - t0
        self.num_steps += 1
        self.num_generated_tokens += len(output.token_ids)

    def _collect(self, finished: list[Request]) -> list[PromptResult]:
        """Results of the oldest finished requests: all of them when the device has nothing queued, else
        MIN_RESULTS_PER_STEP or an eighth of them, whichever is more (the rest in later steps)."""
        self._finished.extend(finished)
        num = len(self._finished)
        if self._in_flight is not None or self.scheduler.has_work:
            num = min(num, max(MIN_RESULTS_PER_STEP, -(-num // 8)))
        done = []
        for req in (self._finished.popleft() for _ in range(num)):
            prompt_id = req.prompt_id
            result, params, remaining = self._pending[prompt_id]
            try:
                ids = text_token_ids(req.output_token_ids, req.finish_reason, params.stop_token_ids)
                text = (final_text(self.tokenizer, ids, params.stop,
                                   cut_at_stop=req.finish_reason is FinishReason.STOP_STRING)
                        if self.tokenizer is not None else None)
            except Exception as e:  # the tokenizer refused this sample's ids: it alone fails
                text, req.finish_reason = None, FinishReason.ERROR
                req.error, req.error_class = f"{req.request_id}: detokenizing failed: {e}", "detokenize_error"
            result.samples.append(Sample(
                sample_idx=req.sample_idx, token_ids=list(req.output_token_ids), text=text,
                finish_reason=req.finish_reason.value, seed=req.seed, num_cached_tokens=req.num_cached_tokens,
                error=req.error, error_class=req.error_class, logprobs=list(req.output_logprobs) if params.logprobs is not None else None,
                **top_logprob_arrays(req, params.logprobs)))
            if req.scores_prompt:
                result.prompt_logprobs = req.prompt_logprobs
            if remaining == 1:
                del self._pending[prompt_id]
                result.samples.sort(key=lambda s: s.sample_idx)
                done.append(result)
            else:
                self._pending[prompt_id] = (result, params, remaining - 1)
        return done

    # ---- batch interface -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[PromptResult]:
        """Generate for every prompt; results in prompt order."""
        if isinstance(sampling, SamplingParams) or sampling is None:
            params_list = [sampling or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        results: dict[str, PromptResult] = {}
        while self.has_unfinished:
            for r in self.step():
                results[r.request_id] = r
        return [results[i] for i in ids]

    def chat(self, conversations: Sequence[Sequence[dict]],
             sampling: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template_kwargs: dict | None = None) -> list[PromptResult]:
        """Generate the assistant's reply to each conversation (a list of {role, content} messages), rendered
        by the tokenizer's chat template with the generation prompt; results in conversation order."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat() needs an engine built with a tokenizer that has a chat template; use "
                             "generate() with raw prompts otherwise")
        check_chat_template_kwargs(chat_template_kwargs or {}, key="chat_template_kwargs")
        prompts = []
        for i, messages in enumerate(conversations):
            if isinstance(messages, (str, dict)) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                           for m in messages):
                raise ValueError(f"conversation {i} must be a list of {{role, content}} messages, got "
                                 f"{str(messages)[:200]}")
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                                      **(chat_template_kwargs or {}))
            # the template writes the special tokens (BOS) itself: none are added again
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling)


__all__ = ["Engine", "EngineConfig", "FinishReason", "PromptResult", "Sample"]

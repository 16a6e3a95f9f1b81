"""JobLoop: one worker's run over its rows. Setup (source, model, prompts, fingerprint, resume state,
writer, engine), then the loop: keep the engine fed, step it, hand finished rows to the shard writer."""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

import batchgen
from batchgen import __version__
from batchgen.errors import JobError
from batchgen.job.rows import completion_rows, prepare_row
from batchgen.job.feed import WAIT, StaticFeed
from batchgen.job.idle_trace import IdleTrace, PassMarks
from batchgen.job.result import RunResult
from batchgen.job.metrics import ThroughputMeter, peak_rss_mib
from batchgen.output import faults
from batchgen.output import manifest as mf
from batchgen.output import generation_columns as gen
from batchgen.output import upstream_order
from batchgen.output.fingerprint import check_or_write, components, own_context
from batchgen.output.keyset import KeySet
from batchgen.output.schema import OutputSchema, fits, key_type_error, with_committed_kept_types
from batchgen.output.shard_writer import ShardWriter
from batchgen.prompts import PromptRenderer, RowError
from batchgen.runner.loader import fingerprint_config, load_model, model_source, resolve_device
from batchgen.job import preflight
from batchgen.job.row_sampling import RowSampling
from batchgen.sample.grammar_checks import unenforced_warning
from batchgen.sources import open_source, refuse_ignored_keys
from batchgen.sources.batchgen_output import OutputDirSource
from batchgen.config import JobSpec
from batchgen.job.workers import WorkerInfo

# A sequence's own fault (its grammar, its tokenizer output: engine.request.RequestFault) rejects its row and the
# job goes on. A fault of no known class ("engine_error") may be the engine's: such rows are held back, rejected
# once a later row is generated (the engine works: they were the rows' faults) or at the end of the run; this many
# held at once means the engine is broken: the job stops (exit 1) and the held rows, never committed, are
# generated again by the next run.
MAX_CONSECUTIVE_ENGINE_ERRORS = 32

# A dealt feed (Ray) whose engine has waited this long for rows commits every finished row, whatever
# output.rows_per_shard and output.commit_interval_s say: the dealer waits for those commits (a gap between two
# deals is shorter: no small shard then). Held engine-error rows are rejected then only once the dealer has dealt
# its whole queue (the job's tail): before, they wait for a generated row or the breaker, as anywhere.
IDLE_COMMIT_S = 0.5


def normalize_key(value: Any, position: int, key_column: str) -> str | int:
    if value is None:
        raise JobError(f"source.key_column {key_column!r} is null at row {position}; keys must be unique "
                       f"non-null strings or integers")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise JobError(f"source.key_column {key_column!r} holds a {type(value).__name__} at row {position}; "
                       f"keys must be strings or integers")
    return value


def unparsed_row_key(position: int, key_column: str, first_seen: KeySet) -> str:
    """The key of an unparseable row whose key the source does not know: a stand-in naming its position, recorded
    in `first_seen` like any key, so a real key spelled the same stops the job (each would be committed under it)."""
    key = f"<unparsed row {position}>"
    earlier = first_seen.add(key, position)
    if earlier is not None:
        raise JobError(f"source.key_column {key_column!r}: row {earlier}'s key {key!r} is the key batchgen gives row "
                       f"{position}, which could not be parsed (its reject is recorded under that key); fix or remove "
                       f"row {position}, or change row {earlier}'s key")
    return key


def unique_key(value: Any, position: int, key_column: str, first_seen: KeySet) -> str | int:
    """The row's key, recorded in `first_seen`; a null, wrongly typed or duplicate key stops the job (run and
    validate give the same message)."""
    key = normalize_key(value, position, key_column)
    earlier = first_seen.add(key, position)
    if earlier is not None:
        fix = ("an OpenAI batch file's custom_ids must be unique" if key_column == "custom_id" else
               "keys must be unique, or drop key_column to key rows by position")
        if key == f"<unparsed row {earlier}>":  # row `earlier` may be a row that could not be parsed
            fix += f" ({key!r} is also the key batchgen gives row {earlier} when it cannot parse it)"
        raise JobError(f"source.key_column {key_column!r} has the duplicate key {key!r} (rows {earlier} and "
                       f"{position}); {fix}")
    return key


def _owned_tags(ledger, worker: WorkerInfo, dealt: bool) -> set[str]:
    """The worker tags whose crash leftovers this worker deletes: its own; for worker 0 of a fixed partition also
    those beyond today's count (an earlier, wider run, including a worker of it killed in its first commit: a
    leftover shard and no manifest). A dealt job's driver tidies those before it starts any worker (its worker
    count may grow while it runs)."""
    owned = {mf.worker_tag(worker.index)}
    if worker.index == 0 and not dealt:
        owned |= mf.tags_from(ledger, worker.count)
    return owned


class JobLoop:
    def __init__(self, spec: JobSpec, out_dir: Path, worker: WorkerInfo, show_progress: bool,
                 tensor_parallel=None, dealt: bool = False) -> None:
        """`dealt`: the rows come from a feed set later with `use_feed` (units dealt while the job runs: the
        worker's index names its files only); else this worker's fixed part (StaticFeed)."""
        from transformers import AutoConfig, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one progress bar: ours
        setup_started = time.monotonic()
        # from importing batchgen to here: mostly the imports of torch and transformers, then the job's checks
        self.startup_s = setup_started - batchgen.IMPORT_STARTED_MONOTONIC

        self.spec, self.out_dir, self.worker = spec, out_dir, worker
        self.tp = tensor_parallel  # distributed.TensorParallelGroup of which this process is rank 0, or None
        refuse_ignored_keys(spec.source)
        self.source = open_source(spec.source)
        if not dealt:
            self.worker = worker = worker.sized_for(spec.source.worker_unit_rows, self.source)  # same in every worker
        self.feed = None if dealt else StaticFeed(self.source, worker)
        # Everything that can refuse the job or find it done needs only the tokenizer and the config: the
        # weights load when the first row needs the engine (a refused resume or a finished job loads none).
        self.device = resolve_device(spec.model.device)
        try:
            self.model_source = model_source(spec.model.path, spec.model.gguf_file)
            tokenizer = AutoTokenizer.from_pretrained(self.model_source)
            config = AutoConfig.from_pretrained(self.model_source)
        except (OSError, ValueError) as e:
            raise JobError(f"cannot load model.path {spec.model.path!r}"
                           + (f" (gguf_file {spec.model.gguf_file!r})" if spec.model.gguf_file else "")
                           + f": {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        self.tokenizer = tokenizer
        self.reasoning = gen.resolve_markers(spec, tokenizer)  # output.reasoning: None keeps `completion` whole
        self.think_markers = gen.budget_markers(spec, tokenizer, self.reasoning)  # sampling.thinking_budget's
        self.schema = OutputSchema.build(spec, self.source.schema, reasoning=self.reasoning is not None)
        self.schema = with_committed_kept_types(out_dir / "data", self.schema)  # a resume's, typed as its shards
        # the job's `sampling:`, or a row's own
        self.row_sampling = RowSampling(spec, self.source.columns, config.get_text_config().vocab_size,
                                        warn=lambda w: print(w, file=sys.stderr))
        warning = unenforced_warning(spec.sampling.response_format)  # structured output: keywords not enforced
        if warning is not None:
            print(warning, file=sys.stderr)
        self.engine = None  # built by _engine() on the first row that needs it
        self.held_engine_errors: list[tuple] = []  # (key, position, message): "engine_error" rows since the last
        # row generated, not yet handed to the writer (MAX_CONSECUTIVE_ENGINE_ERRORS says why)
        self.engine_setup_s = 0.0
        self.engine_compile_s = 0.0  # Triton builds during the engine's set-up (part of setup_s)
        self.engine_builds: list[dict] = []  # the Triton builds of the engine's set-up (meter.totals.builds: later)
        max_prompt = preflight.max_prompt_tokens(spec, config)  # before any weight loads
        preflight.check_kv_cache_fits(spec, config, self.device)
        self.renderer = PromptRenderer(spec.prompt, tokenizer, self.source.columns, max_prompt)
        model_config = fingerprint_config(config, spec.model.dtype, spec.model.device)
        check_or_write(out_dir, components(spec, model_config, tokenizer, __version__), own_context(model_config))
        if isinstance(self.source, OutputDirSource) and spec.source.key_column is None:  # keyed by position
            upstream_order.check_and_record(out_dir, self.source.out_dir, self.source.order, spec.source.limit)

        # every worker's records checked (damage stops the run, nothing deleted), then this worker's crash leftovers
        # deleted; the committed keys are the rows to skip
        self.done_keys = mf.prepare_resume(out_dir, lambda ledger: _owned_tags(ledger, worker, dealt))
        self.writer = ShardWriter(out_dir, mf.Manifest(out_dir, worker.index), self.schema.data,
                                  self.schema.key_field, spec.output.rows_per_shard, spec.output.commit_interval_s)
        expected = None if dealt else self.source.progress_rows() if show_progress else self.source.expected_rows
        mine = None if expected is None else worker.num_owned(expected)
        self.idle_trace = IdleTrace()  # what the host did while the device waited (CUDA, async engine)
        self.meter = ThroughputMeter(out_dir / "logs" / f"throughput-{self.writer.manifest.tag}.jsonl", mine,
                                     show_progress=show_progress)
        self.setup_s = time.monotonic() - setup_started  # checks, tokenizer; _engine() adds the model and engine

    def use_feed(self, feed) -> None:
        """The feed of a dealt job (job/feed.py's contract), before run()."""
        self.feed = feed

    def refresh_done_keys(self) -> None:
        """Read every worker's committed keys again (not deleting anything): before rows another worker held
        are generated here, the ones it committed are skipped. Call from the loop's thread."""
        self.done_keys = mf.checked_ledger(self.out_dir).keys

    def _engine(self):
        """The engine, built on first use: model weights, KV cache, CUDA graphs."""
        if self.engine is not None:
            return self.engine
        t0 = time.monotonic()
        builds0 = len(self.meter.totals.builds)
        compile_s0 = self.meter.totals.compile_s  # builds during set-up (first-step check, graph capture) are
        from batchgen.engine.engine import Engine
        from batchgen.attention.kv_cache import KVCacheUnsupported
        from batchgen.models.registry import DeterministicUnsupported

        spec = self.spec
        tp = self.tp
        if tp is not None:
            tp.plans.send_build()  # the other ranks load their shards and build their engines meanwhile
        try:
            model = load_model(self.model_source, spec.model.dtype, spec.model.device,
                               shard=(tp.rank, tp.size) if tp is not None else None)
        except (OSError, ValueError) as e:
            raise JobError(f"cannot load the weights of model.path {spec.model.path!r}: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}") from None
        try:
            faults.raise_if_armed("engine_build", MemoryError("injected: out of memory building the engine"))
            self.engine = Engine(model, self.tokenizer, spec.engine, tensor_parallel=tp)
        except (DeterministicUnsupported, KVCacheUnsupported) as e:  # a model or device the settings cannot run on
            raise JobError(str(e)) from None
        except (torch.OutOfMemoryError, MemoryError) as e:
            raise self._out_of_memory(e) from None
        print(self._startup_line(), file=sys.stderr)
        if spec.engine.deterministic:  # (one device per worker: deterministic mode refuses tensor parallelism)
            from batchgen.output.numerics import numerics_stack, record_or_compare

            warning = record_or_compare(self.out_dir, numerics_stack(self.engine.device, __version__))
            if warning is not None:
                print(warning, file=sys.stderr)
        self.engine.reasoning_markers = self.think_markers
        # set-up's, not the loop's: moved out of totals.compile_s (which then holds the builds of shapes first
        # seen mid-run); its kernel counts stay in compiled_kernels
        self.engine_compile_s = self.meter.totals.compile_s - compile_s0
        self.meter.totals.compile_s = compile_s0
        # the set-up's builds set apart, so that the loop's get a list of their own (MAX_BUILDS each)
        self.engine_builds = self.meter.totals.builds[builds0:]
        del self.meter.totals.builds[builds0:]
        # Python's cyclic GC: the model, tokenizer and torch modules are ~millions of tracked objects that live as
        # long as the process; a full (gen 2) pass walked them all mid-run (~0.5 s on a 2-core CPU, the device idle
        # meanwhile). Frozen, they are never scanned again (the job runner owns its process; the Engine API leaves
        # the caller's GC alone). This pass is set-up time, not the loop's GC time.
        t = self.meter.totals
        before = t.gc_s, dict(t.gc_passes), dict(t.gc_max_s)
        gc.collect()
        gc.freeze()
        t.gc_s, t.gc_passes, t.gc_max_s = before
        self.engine_setup_s = time.monotonic() - t0
        self.setup_s += self.engine_setup_s
        return self.engine

    def _out_of_memory(self, e: BaseException) -> JobError:
        """The engine's set-up ran out of memory: the knobs that size it, with their values."""
        engine = self.spec.engine
        if self.device.type == "cpu":
            knobs = (f"engine.num_kv_blocks (now {engine.num_kv_blocks}) or engine.cpu_kv_cache_bytes (now "
                     f"{engine.cpu_kv_cache_bytes})")
        else:
            knobs = (f"engine.gpu_memory_utilization (now {engine.gpu_memory_utilization}), "
                     f"engine.max_num_batched_tokens (now {engine.max_num_batched_tokens}) or "
                     f"engine.max_num_seqs (now {engine.max_num_seqs}), set engine.num_kv_blocks"
                     + ("" if engine.kv_cache_dtype == "fp8" else ", or halve the K/V cache: engine.kv_cache_dtype: fp8"))
        return JobError(f"out of memory while setting up the engine on {self.device}: {str(e).splitlines()[0]}. "
                        f"Lower {knobs}, or use a smaller model.dtype")

    def _startup_line(self) -> str:
        """What actually runs, so that no engine key is silently without effect."""
        spec, tp = self.spec, self.tp
        graphs = self.engine.runner.graphs
        graph_note = f"on to {graphs.max_batch} seqs" if graphs else "off"
        return (f"batchgen: engine on {self.engine.device}: {self.engine.kv_cache.num_blocks} KV blocks of "
                f"{spec.engine.block_size}; {self.engine.capacity.describe()}; CUDA graphs {graph_note}"
                f"{'' if graphs or not spec.engine.cuda_graphs else ' (CUDA only)'}"
                f"{', compiled' if graphs and spec.engine.compile else ''}; "
                f"decode forward {self.engine.runner.decode_forward.name}; "
                f"async pipeline {'on' if self.engine.async_pipeline else 'off'}"
                f"{f'; tensor parallel {tp.size} ranks' if tp is not None else ''}"
                f"{'; deterministic: batch-invariant GEMMs and attention' if spec.engine.deterministic else ''}"
                f"{'; K/V cache fp8' if spec.engine.kv_cache_dtype == 'fp8' else ''}"
                f"{self._fp8_paths()}")

    def _fp8_paths(self) -> str:
        """"; " and which FP8 GEMMs run, for an FP8 checkpoint's start-up line (else "")."""
        from batchgen.quant.scheme import is_fp8, parse

        config = self.engine.model.config
        if not is_fp8(config):
            return ""
        from batchgen.kernels.fp8.gemm import describe_paths

        scheme = parse(config)
        dtype = self.engine.model.get_input_embeddings().weight.dtype  # the activations' (not the fp8 weights')
        return "; " + describe_paths(self.engine.device, dtype, scheme.group_n, scheme.group_k,
                                     scheme.act_quant, self.spec.engine.fp8_gemm)

    def _stats(self) -> dict:
        return self.engine.stats() if self.engine is not None else {}

    # ---- the loop ------------------------------------------------------------------------------
    def run(self, stop) -> Any:

        started = time.monotonic()
        try:
            skipped = self._loop(stop)
        except BaseException:
            self._close_engine()
            # Rows already finished are complete and correct: commit them, unless writing is what failed.
            if not self.writer.failed:
                try:
                    while self._commit():
                        pass
                except Exception:  # the original error is the one to report
                    pass
            self.meter.close()  # also removes its garbage-collector hook from the process
            raise
        self._reject_held_engine_errors()  # fewer than MAX_CONSECUTIVE_ENGINE_ERRORS at the end: the rows' own
        while self._commit():
            pass
        self.meter.maybe_log(self._stats, force=True)
        self.meter.close()
        t = self.meter.totals
        # the loop's wall time without the model load and engine set-up (those are in setup_s)
        report = self._report(time.monotonic() - started - self.engine_setup_s, skipped, stop.signum)
        self._close_engine()
        return RunResult(self.out_dir, t.rows_committed, t.rows_rejected, skipped, stop.signum, report)

    def _close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def _key(self, row, first_seen: KeySet) -> Any:
        key_column = self.spec.source.key_column
        if key_column is None:
            return row.position
        if row.columns is None:  # unparseable: its key if the source still knows it, else its position
            if row.key is None:
                return unparsed_row_key(row.position, key_column, first_seen)
            return unique_key(row.key, row.position, key_column, first_seen)
        key = unique_key(row.columns.get(key_column), row.position, key_column, first_seen)
        if not self.source.typed and not fits(key, self.schema.key_field.type):  # JSONL: types inferred
            raise JobError(key_type_error(key_column, key, row.position, self.schema.key_field.type))
        return key

    def _loop(self, stop) -> int:
        """Keep the engine fed, step it, commit. Returns how many rows earlier runs had committed."""
        writer, totals, feed = self.writer, self.meter.totals, self.feed
        lookahead = 2 * self.spec.engine.max_num_seqs
        # rows rendered and queued per loop pass once the engine holds a step's worth (_wants_rows): rows finishing
        # together (a wave: equal lengths) are replaced over several steps, not in one host stall the device waits out
        refill = max(4, self.spec.engine.max_num_seqs // 16)
        # request id -> (key, position, kept values, prompt, num prompt tokens, SamplingParams)
        pending: dict[str, tuple] = {}
        first_seen = KeySet()  # keys seen in this run with their first position (key column only)
        skipped = 0
        exhausted = False
        idle_since = None  # a dealt feed: when the engine last ran out of rows, while it waits for more
        while True:
            t_admit, setup_before = time.perf_counter(), self.engine_setup_s
            num_admitted = 0  # this pass: rows rendered (skipping rows done earlier is cheap and not counted)
            while stop.signum is None and not exhausted and self._wants_rows(num_admitted, lookahead, refill):
                row = feed.next_row()
                if row is None:
                    exhausted = True
                elif row is WAIT:  # a dealt feed between units: step what the engine holds meanwhile
                    break
                else:
                    key = self._key(row, first_seen)
                    if key in self.done_keys:
                        skipped += 1
                        self.meter.row_skipped()
                        feed.row_skipped(row.position)
                    else:
                        self._admit(row, key, pending)
                        num_admitted += 1
            # the engine's set-up (built on the first admitted row) is in setup_s, not the loop's admission time
            totals.admit_s += time.perf_counter() - t_admit - (self.engine_setup_s - setup_before)
            engine = self.engine
            idle = engine is None or not engine.has_unfinished
            if stop.signum is not None or (exhausted and idle):
                return skipped  # on a signal, in-flight rows are abandoned: the next run generates them
            if idle:  # only a dealt feed gets here (a static one is read until the engine is busy or it ends)
                idle_since = idle_since if idle_since is not None else time.monotonic()
                if time.monotonic() - idle_since >= IDLE_COMMIT_S:
                    # the dealer counts a unit done at its commit, and ends the job only once all are: commit
                    # everything finished; once it has dealt all, settle held rows as the end of a run would
                    if feed.all_dealt():
                        self._reject_held_engine_errors()
                    while self._commit():
                        pass
                while writer.should_commit():
                    self._commit()
                self.meter.maybe_log(self._stats)
                feed.wait(0.05)
                continue
            idle_since = None
            faults.raise_if_armed("engine_step", RuntimeError("injected engine failure"))
            faults.slow_if_armed("engine_step")
            t0 = time.perf_counter()
            for result in engine.step():
                self._finish(result, pending.pop(result.request_id))
            t_finished = time.perf_counter()
            totals.step_s += t_finished - t0
            while writer.should_commit():
                self._commit()
            t_committed = time.perf_counter()
            self.meter.maybe_log(self._stats)
            self.idle_trace.add_pass(PassMarks(t_admit, t0, engine.host_marks, t_finished, t_committed,
                                               time.perf_counter()))
            self.idle_trace.add_gaps(engine.take_idle_gaps())

    def _wants_rows(self, num_admitted: int, lookahead: int, refill: int) -> bool:
        """Whether this loop pass renders another row: always while the engine holds fewer prompts than one step
        takes (or is not built yet); else up to `lookahead` prompts, at most `refill` rows a pass."""
        if self.engine is None:
            return True
        queued = self.engine.num_unfinished_prompts
        return queued < self.spec.engine.max_num_seqs or (queued < lookahead and num_admitted < refill)

    def _admit(self, row, key, pending: dict) -> None:
        if row.columns is None:
            self._reject(key, row.position, "malformed_row", row.error or "unreadable row")
            return
        try:
            p = prepare_row(row.columns, key, self.renderer, self.schema, self.row_sampling, self.source.typed)
        except RowError as e:
            self._reject(key, row.position, e.error_class, str(e))
            return
        try:
            rid = self._engine().add_request(p.token_ids, p.params, sample_seeds=p.seeds)
        except ValueError as e:  # a row's own thinking_budget without usable think markers, or logit_bias ids
            self._reject(key, row.position, "bad_sampling", str(e))
            return
        pending[rid] = (key, row.position, p.kept, p.text, len(p.token_ids), p.params)
        self.meter.totals.prompt_tokens += len(p.token_ids)

    def _reject_held_engine_errors(self) -> None:
        for key, position, message in self.held_engine_errors:
            self._reject(key, position, "engine_error", message)
        self.held_engine_errors.clear()

    def _reject(self, key, position: int, error_class: str, message: str) -> None:
        t = self.meter.totals
        self.writer.add_reject(key, position, error_class, message)
        self.feed.row_handed(position)
        t.rows_rejected += 1
        t.rows_done += 1
        t.rejects_by_class[error_class] = t.rejects_by_class.get(error_class, 0) + 1
        self.meter.row_finished(0)

    def _finish(self, result, entry) -> None:
        key, position, kept, prompt, num_prompt, params = entry
        errors = [s for s in result.samples if s.error is not None]
        if errors:  # one sample's fault rejects the row: rows are committed whole, all n samples or none
            error_class = errors[0].error_class or "engine_error"
            if error_class != "engine_error":
                self._reject(key, position, error_class, errors[0].error)
                return
            self.held_engine_errors.append((key, position, errors[0].error))
            if len(self.held_engine_errors) >= MAX_CONSECUTIVE_ENGINE_ERRORS:
                raise RuntimeError(f"the engine failed on {len(self.held_engine_errors)} rows in a row with none "
                                   f"generated between them (the last: {errors[0].error}); the engine's fault, "
                                   f"not the rows': none of them is recorded")
            return
        self._reject_held_engine_errors()  # a row generated: the engine works, those were the rows' own faults
        out_rows = completion_rows(self.spec, self.schema.key_field.name, self.tokenizer, self.reasoning, key, kept,
                                   prompt, num_prompt, params, result)
        t = self.meter.totals
        for s in result.samples:
            t.generated_tokens += len(s.token_ids)
            t.cached_tokens += s.num_cached_tokens
            t.finish_reasons[s.finish_reason] = t.finish_reasons.get(s.finish_reason, 0) + 1
        self.writer.add_row(key, out_rows)
        self.feed.row_handed(position)
        t.rows_done += 1
        self.meter.row_finished(sum(len(s.token_ids) for s in result.samples))

    def _commit(self) -> int:
        t0 = time.perf_counter()
        n = self.writer.commit()
        self.feed.committed(n)
        self.meter.totals.rows_committed += n
        self.meter.totals.commit_s += time.perf_counter() - t0
        return n

    def _report(self, wall_s: float, skipped: int, signum: int | None) -> dict[str, Any]:
        t = self.meter.totals
        return {
            "worker": {"index": self.worker.index, "count": self.worker.count},
            "status": "interrupted" if signum is not None else "complete",
            "startup_s": round(self.startup_s, 3), "setup_s": round(self.setup_s, 3), "wall_s": round(wall_s, 3),
            "rows_committed": t.rows_committed, "rows_rejected": t.rows_rejected,
            "rows_skipped_already_done": skipped, "prompt_tokens": t.prompt_tokens,
            "generated_tokens": t.generated_tokens, "cached_prompt_tokens": t.cached_tokens,
            "generated_tok_s": round(t.generated_tokens / max(t.step_s, 1e-9), 2),
            "loop_s": {"step": round(t.step_s, 3), "admit": round(t.admit_s, 3), "commit": round(t.commit_s, 3),
                       "gc": round(t.gc_s, 3), "triton_compile": round(t.compile_s, 3)},
            "gc_passes": {gen: {"num": n, "max_ms": round(1e3 * t.gc_max_s[gen], 2)}
                          for gen, n in sorted(t.gc_passes.items())},
            "triton_kernels_compiled": t.compiled_kernels,
            "engine_setup_triton_compile_s": round(self.engine_compile_s, 3),
            # what built where (set-up: first-step check and graph capture; loop: shapes first seen mid-run)
            "triton_builds": {"setup": self.engine_builds, "loop": t.builds, "not_listed": t.builds_dropped},
            "rows_s": round(t.rows_done / max(wall_s, 1e-9), 3),
            "finish_reasons": t.finish_reasons, "rejects_by_class": t.rejects_by_class,
            "engine": self._stats(), "idle_gaps": self.idle_trace.summary(),
            "peak_rss_mib": round(peak_rss_mib(), 1), "time": time.time(),
        }

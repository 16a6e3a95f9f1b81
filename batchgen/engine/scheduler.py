"""Scheduler: which sequences run in the next step, and how many tokens each. Pure Python.

Policy (per step, within `max_num_batched_tokens` and `max_num_seqs`):
1. running sequences, oldest first: a decode token, or the next chunk of an unfinished prefill;
   when blocks run out, the newest running sequence is preempted (blocks freed, recomputed later);
2. then, if nothing was preempted, waiting sequences in FIFO order, each served from the prefix
   cache as far as it goes, its prefill chunked to the remaining budget.
Cost per step is O(running), never O(waiting): only the head of the queue is looked at.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from batchgen.engine.batch import ScheduledBatch, SeqSampling, SeqSchedule, StepOutput
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.request import FinishReason, Request, RequestStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first
        self._done: list[Request] = []  # finished or failed since the last `take_finished`
        self._in_flight: dict[int, list[Request]] = {}  # id(batch) -> its requests, until `update`
        self.num_preemptions = 0
        # rows of the runner's PenaltyTable, one per running penalised sequence (running <= max_num_seqs)
        self._free_penalty_slots = list(range(max_num_seqs - 1, -1, -1))

    # ---- admission -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request, or fail it (and its followers) at once if it can never run."""
        reason = self._never_fits(req)
        if reason is not None:
            for r in [req, *req.followers]:
                r.status, r.finish_reason, r.error = RequestStatus.FAILED, FinishReason.ERROR, reason
                r.error_class = "too_long_for_cache" if req.num_prompt_tokens else "empty_prompt"
                self._done.append(r)
            return
        self.waiting.append(req)

    def _never_fits(self, req: Request) -> str | None:
        if req.num_prompt_tokens == 0:
            return "empty prompt (0 tokens)"
        if req.num_prompt_tokens >= req.max_model_len + (req.params.max_new_tokens == 0):  # scoring fills it
            return (f"prompt has {req.num_prompt_tokens} tokens; the model's context is {req.max_model_len} "
                    f"tokens and at least one must be left to generate")
        bm = self.block_manager
        need = bm.blocks_needed(req.max_num_tokens)
        if need > bm.num_blocks:
            return (f"needs {need} KV blocks ({req.max_num_tokens} tokens) but the whole cache holds "
                    f"{bm.num_blocks} blocks of {bm.block_size}; lower max_new_tokens or give the KV cache more memory")
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_finished(self) -> bool:
        """Finished (or failed) requests not yet taken by take_finished."""
        return bool(self._done)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        reqs: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if not req.can_extend():
                i += 1
                continue
            num_new = min(req.num_tokens + req.num_pending - req.num_computed_tokens, budget)
            if num_new <= 0:  # scoring only (max_new_tokens 0): the prompt is all scheduled, its update is due
                i += 1
                continue
            while not bm.ensure_capacity(req.block_table, req.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted_request_ids.append(victim.request_id)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                self._emit(batch, reqs, req, num_new)
                budget -= num_new
                i += 1
        if not batch.preempted_request_ids:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if req.num_pending:  # preempted with a token in flight: admit once it is known
                    break
                hits = bm.match_prefix(req.token_ids)
                if req.scores_prompt:  # cached tokens have no logits: serve only positions already scored
                    hits = hits[:req.num_scored_prompt_positions // bm.block_size]
                num_cached = len(hits) * bm.block_size
                num_new = min(req.num_tokens - num_cached, budget)
                num_new_blocks = bm.blocks_needed(num_cached + num_new) - len(hits)
                if not bm.can_allocate(hits, num_new_blocks):
                    break
                self.waiting.popleft()
                bm.take_cached(hits)
                req.block_table = list(hits) + bm.allocate(num_new_blocks)
                req.num_computed_tokens = num_cached
                if req.num_preemptions == 0:
                    req.num_cached_tokens = num_cached
                req.status = RequestStatus.RUNNING
                if req.params.uses_penalty_table:
                    req.penalty_slot, req.penalty_history_sent = self._free_penalty_slots.pop(), False
                self.running.append(req)
                self._emit(batch, reqs, req, num_new)
                budget -= num_new
        if batch:
            self._in_flight[id(batch)] = reqs
        return batch

    def _emit(self, batch: ScheduledBatch, reqs: list[Request], req: Request, num_new: int) -> None:
        """Add `num_new` tokens of `req` to the batch. The GPU computes them in this step, so they count as
        computed from now on; a sampled token counts as pending until `update` brings its id."""
        start = req.num_computed_tokens
        end = start + num_new
        inputs = tuple(req.token_ids[start:end])
        carry_from = None
        if end > req.num_tokens:  # the last input is the token the in-flight step samples
            assert req.num_pending == 1 and end == req.num_tokens + 1, "pipeline deeper than one step"
            inputs, carry_from = inputs + (0,), req.pending_row
        lp_offset, lp_targets = self._prompt_logprob_span(req, start, end) if req.scores_prompt else (0, ())
        sampling = None
        if end == req.num_tokens + req.num_pending and req.params.max_new_tokens > 0:
            sampling = self._sampling_row(req, carry_from)
            req.pending_row = batch.num_samples
            batch.num_samples += 1
            req.num_pending += 1
        batch.seqs.append(SeqSchedule(
            request_id=req.request_id, input_token_ids=inputs, start_pos=start, block_table=req.block_table_view(),
            sampling=sampling, carry_from=carry_from,
            prompt_logprob_offset=lp_offset, prompt_logprob_targets=lp_targets,
        ))
        if lp_targets or (sampling is not None and sampling.logprobs >= 0):
            batch.num_logprob_seqs += 1
        if sampling is not None and num_new == 1:
            batch.num_decode_tokens += 1
        else:
            batch.num_prefill_tokens += num_new
        if sampling is not None:
            batch.num_forced += sampling.forced_token_id >= 0
            batch.num_constrained += sampling.grammar is not None  # structured output
        req.num_computed_tokens = end
        # Full blocks of known tokens become findable now, so a later request in this same step can share
        # them: every layer writes the step's new K/V before any sequence attends, and later steps run after.
        # (Tested here first: most steps complete no block, and the call alone costs ~1 us a sequence.)
        known = min(end, len(req.token_ids))
        if known // self.block_manager.block_size > len(req.block_keys):
            self.block_manager.register_full_blocks(req.token_ids, req.block_table, req.block_keys, known)
        reqs.append(req)

    @staticmethod
    def _prompt_logprob_span(req: Request, start: int, end: int) -> tuple[int, tuple[int, ...]]:
        """(offset into this step's inputs, prompt tokens they score) of a request scoring its prompt; (0, ()) when
        none. Positions [lo, hi) score prompt tokens lo+1 .. hi; position P - 1 samples and scores none."""
        lo, hi = max(start, req.num_scored_prompt_positions), min(end, req.num_prompt_tokens - 1)
        if hi <= lo:
            return 0, ()
        req.num_scored_prompt_positions = hi
        return lo - start, tuple(req.prompt_token_ids[lo + 1:hi + 1])

    @staticmethod
    def _sampling_row(req: Request, carry_from: int | None) -> SeqSampling:
        """The request's sampling row for this step: its last one while the sequence's state is unchanged (it is
        immutable, so sharing it is safe), else a new one."""
        suppressed = req.suppressed_token_ids()
        forced = req.thinking.forced_token() if req.thinking is not None else -1
        assert forced < 0 or req.num_pending == 0, "a forced token must follow a known one"
        cached = req.last_sampling
        first_penalised = req.penalty_slot >= 0 and not req.penalty_history_sent
        if (cached is not None and not first_penalised and cached.penalty_history is None
                and cached.penalty_slot == req.penalty_slot and cached.suppressed_token_ids == suppressed
                and cached.forced_token_id == forced):
            return cached
        req.last_sampling = SeqSampling(
            params=req.params, seed=req.seed, suppressed_token_ids=suppressed, penalty_slot=req.penalty_slot,
            penalty_num_prompt=req.num_prompt_tokens,
            # the slot's first sampling step: every token is known (no carry-over right after admission)
            penalty_history=np.array(req.token_ids, dtype=np.int64) if first_penalised else None,
            forced_token_id=forced,
            grammar=req.grammar,  # structured output (fixed for the request's life)
        )
        if first_penalised:
            assert carry_from is None, "a penalty history with a token in flight"
            req.penalty_history_sent = True
        return req.last_sampling

    def _release_penalty_slot(self, req: Request) -> None:
        """The slot's row is reinitialised by its next owner's first step, queued after this one's marks."""
        if req.penalty_slot >= 0:
            self._free_penalty_slots.append(req.penalty_slot)
            req.penalty_slot = -1

    def _preempt(self, req: Request) -> None:
        # A token in flight stays pending: `update` appends it while the request waits.
        self._release_penalty_slot(req)
        self.block_manager.free(req.block_table)
        req.block_table, req.block_keys, req.num_computed_tokens = [], [], 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    # ---- results -------------------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """Apply a step's results: append sampled tokens, finish sequences, register computed blocks.

        `output.token_ids` holds one token per sequence with `sampling`, in `batch.seqs` order. With the async
        pipeline the next step is already dispatched: a sequence that finishes here may be in it; its token
        from that step is dropped, and its blocks are freed now (the GPU runs steps in order, so that step's
        writes land before any later owner of the blocks writes)."""
        bm = self.block_manager
        tokens = iter(output.token_ids)
        lp_row = prompt_at = 0  # next row of output.logprobs / next value of output.prompt_logprobs
        for seq, req in zip(batch.seqs, self._in_flight.pop(id(batch))):
            if seq.prompt_logprob_targets:  # lands even if preempted since: those positions count as scored
                n = len(seq.prompt_logprob_targets)
                first = seq.start_pos + seq.prompt_logprob_offset + 1  # the prompt index the first value scores
                req.prompt_logprobs[first:first + n] = output.prompt_logprobs[prompt_at:prompt_at + n].tolist()
                prompt_at += n
            if req.params.max_new_tokens == 0 and seq.seq_len == req.num_prompt_tokens and not req.is_finished:
                self._finish(req, FinishReason.LENGTH)  # scoring only: the prompt is computed, nothing to sample
            if seq.sampling is not None:
                token = next(tokens)
                lp = seq.sampling.logprobs
                if lp >= 0:
                    lp_row += 1
                if req.is_finished:
                    continue  # finished at the previous step; this token was computed in vain
                req.num_pending -= 1
                try:
                    if lp >= 0:
                        self._append_logprobs(req, output, lp_row - 1, lp)
                    reason = req.append_token(token)
                except Exception as e:  # this sequence's own fault: it alone ends (RequestFault says which)
                    req.error = f"{req.request_id}: {e}"
                    req.error_class = getattr(e, "error_class", "engine_error")
                    reason = FinishReason.ERROR
                if reason is not None:
                    self._finish(req, reason)
                    self._release_followers(req)  # a parent done at its first token still starts its siblings
                    continue
            if req.status is RequestStatus.RUNNING:  # blocks completed by the token just appended (tested first)
                known = min(req.num_computed_tokens, len(req.token_ids))
                if known // bm.block_size > len(req.block_keys):
                    bm.register_full_blocks(req.token_ids, req.block_table, req.block_keys, known)
            self._release_followers(req)

    def _release_followers(self, req: Request) -> None:
        """Queue a request's sibling samples (n > 1) at the head of the queue once its prompt is computed (its
        full blocks are then cached: the siblings reuse them from the prefix cache) or it has finished."""
        if req.followers and (req.is_finished or req.num_computed_tokens >= req.num_prompt_tokens):
            followers, req.followers = req.followers, []
            self.waiting.extendleft(reversed(followers))

    @staticmethod
    def _append_logprobs(req: Request, output: StepOutput, row: int, k: int) -> None:
        req.output_logprobs.append(float(output.logprobs[row]))
        if k > 0:  # views into this step's arrays: the request keeps them, nothing is converted per value
            req.output_top_ids.append(output.top_token_ids[row, :k])
            req.output_top_values.append(output.top_logprobs[row, :k])

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self._release_penalty_slot(req)
        self.block_manager.free(req.block_table)
        req.block_table = []
        (self.running if req.status is RequestStatus.RUNNING else self.waiting).remove(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        self._done.append(req)

    def take_finished(self) -> list[Request]:
        done, self._done = self._done, []
        return done

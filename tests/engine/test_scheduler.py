"""Scheduler on plain Python data (no model): budgets, chunked prefill, preemption, followers."""

from __future__ import annotations

import numpy as np

from batchgen.engine.batch import StepOutput
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.scheduler import Scheduler
from batchgen.sampling_params import SamplingParams


def _req(rid: str, prompt_len: int, max_new: int = 4, start: int = 0) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(start, start + prompt_len)),
                   params=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True), seed=0,
                   eos_token_ids=frozenset({2}), max_model_len=1000)


def _step(s: Scheduler, token: int = 7):
    batch = s.schedule()
    s.update(batch, StepOutput([token] * batch.num_samples))
    return batch


def test_token_budget_chunks_prefill_and_decodes_come_first():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = _req("a", 3), _req("b", 25, start=100)
    s.add(a)
    s.add(b)
    batch = _step(s)
    assert [(x.request_id, x.num_new_tokens, x.sampling is not None) for x in batch.seqs] == [("a", 3, True), ("b", 7, False)]
    batch = _step(s)
    assert [(x.request_id, x.num_new_tokens) for x in batch.seqs] == [("a", 1), ("b", 9)]
    assert batch.num_decode_tokens == 1 and batch.num_prefill_tokens == 9
    batch = _step(s)
    assert [(x.request_id, x.num_new_tokens, x.start_pos) for x in batch.seqs] == [("a", 1, 4), ("b", 9, 16)]
    assert batch.seqs[1].sampling is not None  # b's prefill is complete: it samples


def test_max_num_seqs_caps_running_sequences():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        s.add(_req(f"r{i}", 3, start=10 * i))
    batch = _step(s)
    assert [x.request_id for x in batch.seqs] == ["r0", "r1"]
    assert len(s.waiting) == 3


def test_newest_running_request_is_preempted_when_blocks_run_out_and_nothing_deadlocks():
    s = Scheduler(BlockManager(6, 4), max_num_seqs=8, max_num_batched_tokens=100)
    reqs = [_req(f"r{i}", 7, max_new=10, start=10 * i) for i in range(3)]
    for r in reqs:
        s.add(r)
    _step(s)  # r0, r1, r2 admitted: 7 prompt tokens in 2 blocks each, cache full; 1 token sampled
    assert not _step(s).preempted_request_ids  # the 8th token still fits in the 2nd block
    batch = _step(s)  # the 9th needs a 3rd block: r2 (newest) is preempted
    assert batch.preempted_request_ids == ["r2"]
    assert reqs[2].status is RequestStatus.WAITING and reqs[2].num_computed_tokens == 0
    assert s.waiting[0] is reqs[2]
    steps = 0
    while s.has_work:
        _step(s)
        steps += 1
        assert steps < 200
    assert all(len(r.output_token_ids) == 10 for r in reqs)
    assert s.block_manager.num_free_blocks == 6


def test_request_that_can_never_fit_fails_at_once_with_its_followers():
    s = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=100)
    big = _req("big", 10, max_new=10)  # 20 tokens: 5 blocks > 4
    big.followers = [_req("big#1", 10, max_new=10)]
    s.add(big)
    s.add(_req("empty", 0))
    failed = s.take_finished()
    assert [r.request_id for r in failed] == ["big", "big#1", "empty"]
    assert "5 KV blocks" in failed[0].error and failed[2].error.startswith("empty prompt")
    assert not s.has_work


def test_followers_wait_for_the_leaders_prompt_then_hit_the_prefix_cache():
    s = Scheduler(BlockManager(50, 4), max_num_seqs=8, max_num_batched_tokens=6)
    leader, follower = _req("p#0", 13), _req("p#1", 13)
    leader.followers = [follower]
    s.add(leader)
    _step(s)  # 6 of 13 prompt tokens
    assert follower.status is RequestStatus.WAITING and follower not in s.waiting
    _step(s)  # 12 of 13
    _step(s)  # prompt complete: follower released
    assert s.waiting[0] is follower
    batch = _step(s)
    assert follower.num_cached_tokens == 12  # 3 full blocks shared
    assert [x.num_new_tokens for x in batch.seqs if x.request_id == "p#1"] == [1]


def test_block_table_views_handed_out_never_change_when_the_table_grows_or_is_replaced():
    import numpy as np
    import pytest

    req = _req("r", 4)
    req.block_table = [5]
    first = req.block_table_view()
    assert first.tolist() == [5] and req.block_table_view() is first  # unchanged: the same view again
    req.block_table.extend(range(100, 140))  # grows past the buffer: a new buffer
    grown = req.block_table_view()
    assert first.tolist() == [5] and grown.tolist() == [5, *range(100, 140)]
    req.block_table.append(7)  # grows inside the buffer: written past the earlier view's end
    assert grown.tolist() == [5, *range(100, 140)] and req.block_table_view()[-1] == 7
    req.block_table = [9, 9]  # preemption / re-admission: a new list, a new buffer
    assert req.block_table_view().tolist() == [9, 9] and grown[0] == 5
    with pytest.raises(ValueError):
        grown[0] = 1  # read-only
    assert req.block_table_view().dtype == np.int32


def test_penalised_sequences_hold_a_table_slot_while_running_and_send_their_history_once_per_admission():
    s = Scheduler(BlockManager(6, 4), max_num_seqs=3, max_num_batched_tokens=100)
    reqs = [_req(f"r{i}", 7, max_new=10, start=10 * i) for i in range(3)]
    for r in reqs:
        r.params = r.params.model_copy(update={"repetition_penalty": 1.3})
        s.add(r)
    first = _step(s, token=5)  # admitted: each samples with its own slot and its whole prompt as history
    assert sorted(x.sampling.penalty_slot for x in first.seqs) == [0, 1, 2]
    assert [x.sampling.penalty_history.tolist() for x in first.seqs] == [list(range(10 * i, 10 * i + 7))
                                                                         for i in range(3)]
    second = _step(s, token=6)
    assert all(x.sampling.penalty_history is None for x in second.seqs)  # later tokens are marked on the device
    preempting = _step(s)  # r2 is preempted (the cache is full): its slot is free again
    assert preempting.preempted_request_ids == ["r2"] and reqs[2].penalty_slot == -1
    while reqs[2].status is not RequestStatus.RUNNING:
        batch = _step(s, token=8)
    back = next(x for x in batch.seqs if x.request_id == "r2")
    # re-admitted: a free slot (none held by a running sequence) and the history again, outputs included
    assert back.sampling.penalty_slot not in {r.penalty_slot for r in reqs[:2] if r.status is RequestStatus.RUNNING}
    assert back.sampling.penalty_history.tolist() == list(range(20, 27)) + [5, 6]
    while s.has_work:
        _step(s)
    assert all(r.penalty_slot == -1 for r in reqs) and sorted(s._free_penalty_slots) == [0, 1, 2]


def _scoring_req(rid: str, prompt_len: int, max_new: int = 4) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(10, 10 + prompt_len)),
                   params=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True, prompt_logprobs=True),
                   seed=0, eos_token_ids=frozenset({2}), max_model_len=1000)


def _step_scored(s: Scheduler, token: int = 7):
    batch = s.schedule()
    num_scored = sum(len(x.prompt_logprob_targets) for x in batch.seqs)
    s.update(batch, StepOutput([token] * batch.num_samples, prompt_logprobs=np.full(num_scored, -1.5, np.float32)))
    return batch


def test_prompt_positions_are_scored_once_across_chunks_and_a_preemption():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=8)
    req = _scoring_req("a", 19)
    s.add(req)
    chunks = [_step_scored(s).seqs[0] for _ in range(3)]  # 8 + 8 + 3 tokens; the last one samples
    assert [(c.start_pos, c.prompt_logprob_offset, c.prompt_logprob_targets) for c in chunks] == [
        (0, 0, tuple(range(11, 19))), (8, 0, tuple(range(19, 27))), (16, 0, (27, 28))]
    assert req.prompt_logprobs == [None] + [-1.5] * 18
    s._preempt(req)
    again = _step_scored(s).seqs[0]  # re-admitted from its own cached blocks: every position is scored already
    assert again.start_pos == 16 and again.prompt_logprob_targets == ()
    assert req.prompt_logprobs == [None] + [-1.5] * 18


def test_a_prompt_to_score_takes_no_prefix_from_the_cache_until_it_scored_it():
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=64)
    s.add(_req("plain", 13, start=10))
    _step(s)
    scored = _scoring_req("scored", 13)  # the same prompt: 3 full blocks are in the cache
    s.add(scored)
    seq = next(x for x in _step_scored(s).seqs if x.request_id == "scored")
    assert seq.start_pos == 0 and len(seq.prompt_logprob_targets) == 12 and scored.num_cached_tokens == 0


def test_the_scheduler_cost_bench_runs_with_and_without_a_repetition_penalty(monkeypatch):
    """bench/scheduler_cost.py (the host-cost A/B of scheduler and sampler changes) keeps working with the API it
    measures: a penalised row's sampling inputs need the runner's PenaltyTable (it broke once, unnoticed)."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    bench = importlib.import_module("scheduler_cost")
    for penalty in (1.0, 1.1):
        row = bench.measure(num_seqs=8, context=32, penalty=penalty, steps=4)
        assert row["repetition_penalty"] == penalty and row["schedule_update_ms"] > 0 and row["sampling_build_ms"] > 0


def _random_run(seed: int, async_pipeline: bool) -> str | None:
    """One random load through the scheduler alone (token 7 sampled; async: step N+1 scheduled before step N's
    tokens are applied, as the engine's pipeline does): None if every sample finished at its exact length, else
    what went wrong."""
    import random

    rng = random.Random(seed)
    block_size, max_seqs = rng.choice([2, 4, 8]), rng.randint(1, 8)
    budget = rng.choice([4, 8, 16, 64, 1000])
    leaders, everyone = [], []
    for i in range(rng.randint(1, 15)):
        n = rng.choice([1, 1, 1, 2, 3])
        length, max_new = rng.randint(1, 40), rng.randint(1, 30)
        prompt = (list(range(1000, 1000 + length)) if rng.random() < 0.3  # shared prefixes: cache hits
                  else [rng.randint(3, 999) for _ in range(length)])
        samples = [Request(request_id=f"r{i}#{j}", prompt_token_ids=prompt, seed=0, eos_token_ids=frozenset({2}),
                           params=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True),
                           max_model_len=200) for j in range(n)]
        samples[0].followers = samples[1:]
        leaders.append(samples[0])
        everyone += samples
    need = max(-(-(len(r.prompt_token_ids) + r.params.max_new_tokens) // block_size) for r in leaders)
    s = Scheduler(BlockManager(rng.randint(need, 4 * need), block_size), max_seqs, budget)  # preemptions
    for r in leaders:
        s.add(r)
    in_flight, idle = None, 0
    for _ in range(20_000):
        if not (s.has_work or in_flight):
            break
        batch = s.schedule()
        if async_pipeline:
            if in_flight is not None:
                s.update(in_flight, StepOutput([7] * in_flight.num_samples))
            in_flight = batch or None
        elif batch:
            s.update(batch, StepOutput([7] * batch.num_samples))
        idle = 0 if batch else idle + 1
        if idle > 3:
            return f"seed {seed}: stuck ({max_seqs} seqs, budget {budget})"
    wrong = [r.request_id for r in everyone
             if r.status is not RequestStatus.FINISHED or len(r.output_token_ids) != r.params.max_new_tokens]
    return f"seed {seed}: {wrong} not finished at their length" if wrong else None


def test_random_loads_finish_every_sample_at_its_length_sync_and_async():
    """Followers (n > 1, some done at their first token), shared prefixes, tiny token budgets, caches that force
    preemption: nothing hangs, nothing is lost or cut short (a
    fuzz like this found a lost-siblings hang)."""
    problems = [p for seed in range(300) for a in (False, True) if (p := _random_run(seed, a))]
    assert problems == []

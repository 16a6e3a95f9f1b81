"""The sampler's filters and noise, against transformers' logits processors where they exist."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from batchgen.engine.batch import SeqSampling
from batchgen.sample.noise import uniform_noise
from batchgen.sample.penalty import PenaltyTable
from batchgen.sample.sampler import SamplingTensors, apply_penalties, sample
from batchgen.sampling_params import SamplingParams


def _row(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0, seed=0, suppress=(), history=None, slot=-1):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=penalty)
    return SeqSampling(params, seed=seed, suppressed_token_ids=tuple(suppress), penalty_slot=slot,
                       penalty_history=history)


def _sample(logits, rows, positions=None):
    positions = positions or list(range(len(rows)))
    table = PenaltyTable(len(rows), logits.shape[-1], logits.device)
    return sample(logits, SamplingTensors.build(rows, positions, logits.shape[-1], logits.device, penalty_table=table))


def _allowed_by(warper, logits):
    return torch.isfinite(warper(None, logits.clone()))


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert _sample(logits, [_row(temperature=0)] * 5).tolist() == logits.argmax(-1).tolist()


def test_top_k_top_p_min_p_never_sample_outside_transformers_allowed_set():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 40, generator=g)
    for row, warper in [(_row(top_k=5), TopKLogitsWarper(5)), (_row(top_p=0.6), TopPLogitsWarper(0.6)),
                        (_row(min_p=0.2), MinPLogitsWarper(0.2))]:
        allowed = _allowed_by(warper, logits)[0]
        tokens = _sample(logits.expand(400, -1), [row] * 400, positions=list(range(400)))
        assert allowed[tokens].all()
        assert allowed.sum() > 2 and len(set(tokens.tolist())) > 1  # still random within the allowed set


def test_sampling_frequencies_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    num = 20000
    tokens = _sample(logits.expand(num, -1), [_row(temperature=1.0, seed=3)] * num, positions=list(range(num)))
    freq = torch.bincount(tokens, minlength=4).float() / num
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.015)
    hot = _sample(logits.expand(num, -1), [_row(temperature=3.0, seed=3)] * num, positions=list(range(num)))
    assert torch.allclose(torch.bincount(hot, minlength=4).float() / num, (logits / 3).softmax(-1)[0], atol=0.015)


def test_repetition_penalty_matches_transformers():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 30, generator=g)
    history = [(3, 7, 7, 12), (0, 29)]
    expected = torch.stack([RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([h]), logits[i:i + 1].clone())[0]
                            for i, h in enumerate(history)])
    rows = [_row(temperature=0, penalty=1.7, history=h, slot=i) for i, h in enumerate(history)]
    got = _sample(logits, rows)
    assert got.tolist() == expected.argmax(-1).tolist()
    st = SamplingTensors.build(rows, [0, 0], 30, logits.device, penalty_table=PenaltyTable(2, 30, logits.device))
    assert torch.equal(apply_penalties(logits, st), expected)  # the penalised logits themselves, bit for bit
    # penalised token that was the argmax loses its place
    peak = torch.full((1, 10), 0.5)
    peak[0, 4] = 1.0
    assert _sample(peak, [_row(temperature=0, penalty=10.0, history=(4,), slot=0)]).item() != 4


def test_suppressed_tokens_are_never_sampled():
    logits = torch.zeros(1, 6)
    logits[0, 2] = 50.0
    assert _sample(logits, [_row(temperature=0, suppress=(2,))]).item() != 2
    tokens = _sample(logits.expand(300, -1), [_row(suppress=(2, 3))] * 300, positions=list(range(300)))
    assert not set(tokens.tolist()) & {2, 3}


def test_a_step_computes_every_rows_noise_key_exactly_as_the_scalar_definition():
    """The vectorised keys (numpy, uint64 wrapping) equal row_noise_key's Python ints, at the edges of the seed
    and position ranges too (a position whose offset passes 2^32 is masked as the scalar masks it)."""
    import random

    import numpy as np

    from batchgen.sample.noise import row_noise_key, row_noise_keys

    rng = random.Random(0)
    seeds = [rng.randrange(1 << 64) for _ in range(300)] + [0, 1, (1 << 32) - 1, 1 << 32, (1 << 64) - 1]
    positions = [rng.randrange(1 << 31) for _ in range(300)] + [0, 1, (1 << 31) - 1, 4294967295 - 0x85EBCA6B + 5, 7]
    assert row_noise_keys(seeds, np.array(positions)).tolist() == [row_noise_key(s, p) for s, p in zip(seeds, positions)]


def test_noise_is_a_function_of_seed_and_position_only():
    rows = [_row(seed=s) for s in (5, 6, 7)]
    keys = SamplingTensors.build(rows, [10, 11, 12], 100, torch.device("cpu")).noise_key
    swapped = SamplingTensors.build(rows[::-1], [12, 11, 10], 100, torch.device("cpu")).noise_key
    assert keys.flip(0).tolist() == swapped.tolist()
    noise = uniform_noise(keys, 100)
    assert torch.equal(noise.flip(0), uniform_noise(swapped, 100))
    assert (noise > 0).all() and (noise < 1).all()
    assert len(set(keys.tolist())) == 3


# A row key whose noise at vocab id 7 is the hash's top draw ((2^24 - 0.5) / 2^24, a float32 tie that rounds to
# 1.0): found by search over keys (mix32 is a bijection, so every vocab id has such keys).
TOP_DRAW_KEY, TOP_DRAW_TOKEN = 8013419, 7


def test_the_noise_never_reaches_one_even_at_the_hashs_top_draw():
    u = uniform_noise(torch.tensor([TOP_DRAW_KEY]), 64)
    assert u.max().item() < 1.0 and u.min().item() > 0.0
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_a_masked_token_is_never_drawn_at_the_hashs_top_draw():
    """The draw that made structured output abort at temperature > 0: noise 1.0 at a -inf (grammar-masked,
    suppressed, filtered) token gave NaN, which argmax picks."""
    V = 64
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    logits[:, TOP_DRAW_TOKEN] = float("-inf")
    rows = [_row(temperature=t, top_k=k, top_p=p, min_p=m)
            for t, k, p, m in ((0.8, 0, 1.0, 0.0), (1.2, 0, 0.9, 0.0), (0.5, 20, 1.0, 0.05), (1.5, 0, 1.0, 0.0))]
    st = SamplingTensors.build(rows, list(range(4)), V, logits.device)
    st.noise_key = torch.full((4,), TOP_DRAW_KEY, dtype=torch.int64)
    drawn = sample(logits, st)
    assert (drawn != TOP_DRAW_TOKEN).all(), drawn.tolist()
    # a finite token there wins no more than its probability says: not a certain draw by +inf noise
    logits[:, TOP_DRAW_TOKEN] = -30.0
    assert (sample(logits, st) != TOP_DRAW_TOKEN).all()

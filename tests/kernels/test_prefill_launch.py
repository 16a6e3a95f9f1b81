"""The paged prefill kernel's launch choice and work lists (kernels/attention/prefill_launch.py), and the GPU sweep that
measures launches (bench/prefill_attention_sweep.py): its shapes and FLOP floor, and its --check mode."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from batchgen.kernels.attention.prefill_launch import (LONG_PROMPT, LONG_PROMPT_LAUNCH, SHORT_PROMPT_LAUNCH, PrefillLaunch,
                                             PrefillWork, prefill_launch, prefill_work)
from conftest import needs_interpreter

ROOT = Path(__file__).resolve().parents[2]


def test_steps_of_short_prompts_take_16_token_items_wasting_little_on_each_sequences_last_item():
    for longest in (1, 68, LONG_PROMPT - 1):
        assert prefill_launch(longest) == SHORT_PROMPT_LAUNCH
        assert prefill_launch(longest).block_m == 16


def test_steps_with_a_long_prompt_take_larger_tiles_on_8_warps():
    for longest in (LONG_PROMPT, 2048, 8192):
        launch = prefill_launch(longest)
        assert launch.block_m > SHORT_PROMPT_LAUNCH.block_m and launch.num_warps == 8


def test_query_rows_wider_than_llamas_bf16_heads_keep_the_short_launch_on_long_prompts():
    # head dim (padded to a power of two) x element bytes: <= 256 takes the long launch, wider rows do not
    assert prefill_launch(4096, 128, 2) == LONG_PROMPT_LAUNCH and prefill_launch(4096, 96, 2) == LONG_PROMPT_LAUNCH
    assert prefill_launch(4096, 64, 4) == LONG_PROMPT_LAUNCH
    for head_dim, element_bytes in ((256, 2), (128, 4), (192, 2), (256, 4)):
        assert prefill_launch(4096, head_dim, element_bytes) == SHORT_PROMPT_LAUNCH, (head_dim, element_bytes)


def test_a_launch_the_kernel_cannot_run_is_refused():
    PrefillLaunch(128, 128, 8, 4)  # the largest allowed
    for bad in (dict(block_m=8), dict(block_m=48), dict(block_n=256), dict(num_warps=2), dict(num_stages=1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PrefillLaunch(**{"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 2, **bad})


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_work_items_cut_each_sequence_into_block_m_tokens_covering_every_token_once(block_m):
    q_lens = np.array([1, 200, 16, 33, 128, 1])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    items = prefill_work(q_lens, qsl, block_m)  # [P, 2]
    assert items.dtype == np.int32 and len(items) == sum(-(-q // block_m) for q in q_lens)
    covered = np.concatenate([np.arange(tok0, min(tok0 + block_m, qsl[seq + 1])) for seq, tok0 in items])
    assert np.array_equal(covered, np.arange(qsl[-1])), "each token in exactly one item, in order"
    assert all(qsl[seq] <= tok0 < qsl[seq + 1] for seq, tok0 in items), "an item inside its own sequence"


def test_a_work_list_travels_with_the_launch_it_was_cut_for():
    q_lens = np.array([1, 1, 700, 30])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    work = PrefillWork.build(q_lens, qsl)
    assert work.launch == prefill_launch(700)
    assert torch.equal(work.items, torch.from_numpy(prefill_work(q_lens, qsl, work.launch.block_m)))
    rest = work.after(2)  # a mixed step's decode rows go to the decode kernel
    assert rest.launch == work.launch and torch.equal(rest.items, work.items[2:])


# ---- bench/prefill_attention_sweep.py ----

@pytest.fixture
def sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("prefill_attention_sweep")


def test_the_sweeps_shapes_and_causal_flop_floor(sweep):
    shape = sweep.Shape.parse("8192x68")
    assert shape.q_lens() == [68] * 120 + [32] and shape.cached == 0
    assert shape.causal_pairs() == 120 * 68 * 69 // 2 + 32 * 33 // 2
    chunk = sweep.Shape.parse("2048x512+1536")
    assert chunk.q_lens() == [512] * 4 and str(chunk) == "2048x512+1536"
    assert chunk.causal_pairs() == 4 * (512 * 1536 + 512 * 513 // 2)
    assert chunk.causal_pairs(window=1000) == 4 * 512 * 1000  # every token sees a full window
    llama = sweep.Geometry(heads=32, kv_heads=8, head_dim=128)
    # 4 prompts of 2,048: 5.5 ms over 32 layers at ~800 TFLOP/s (bench/RESULTS.md)
    four = sweep.Shape.parse("8192x2048")
    assert llama.floor_ms(four, 1e12) == 4 * four.causal_pairs() * 128 * 32 / 1e12 * 1e3
    assert 5.0 < 32 * llama.floor_ms(four, 800e12) < 6.0


@needs_interpreter
def test_the_sweeps_check_mode_finds_every_launch_equal_to_the_reference_under_triton_interpreter(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    report = tmp_path / "check.json"
    result = subprocess.run([sys.executable, "bench/prefill_attention_sweep.py", "--check", "--json", str(report)],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "every launch matches the reference" in result.stdout, result.stderr[-3000:]
    shapes = json.loads(report.read_text())["shapes"]
    rows = [r for s in shapes for r in s["rows"]]
    assert {s["shape"] for s in shapes} == {"48x24", "40x20+28"}  # one of them after cached context
    assert {r["block_m"] for r in rows} == {16, 32, 64, 128} and all(r["ok"] for r in rows)


def test_per_step_values_do_not_multiply_the_prefill_kernels_builds():
    """On an H200 (2026-12-02), on an empty Triton cache, a second build of the prefill kernel (the work list's
    address not 16-byte aligned) and of the rotary + K/V write kernel (a token count not divisible by 16) ran inside
    the timed loop, ~1 s each. Neither value is specialised on; the block-table width never was."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter's functions keep no specialisation flags")
    from batchgen.kernels.attention.paged_prefill import _prefill_kernel
    from batchgen.kernels.attention.rope_kv import _rope_kv_kernel

    prefill = {p.name: p for p in _prefill_kernel.params}
    assert prefill["work_ptr"].do_not_specialize_on_alignment and prefill["stride_bt"].do_not_specialize
    assert not prefill["q_ptr"].do_not_specialize_on_alignment  # the tiles' loads keep their alignment
    rope = {p.name: p for p in _rope_kv_kernel.params}
    assert rope["num_tokens"].do_not_specialize and not rope["stride_qkv"].do_not_specialize

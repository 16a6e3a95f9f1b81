"""The measured decode launch table (kernels/attention/decode_launch.py) and the sweep that writes it
(bench/decode_attention_sweep.py): look-up, split scaling, validation, the heuristic fallback, the merge."""

from __future__ import annotations

import importlib
import itertools
import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from batchgen.kernels.attention.decode_launch import (TABLE_PATH, DecodeLaunch, TableEntry, default_launch, launch_from_table,
                                            load_table, nearest_entry, scaled_splits)
from conftest import run_under_interpreter

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _entry(num_seqs, launch, head_dim=256, num_kv_heads=8, group=2, context=768):
    return TableEntry(head_dim, num_kv_heads, group, num_seqs, context, launch, 100.0, 120.0, "NVIDIA H200")


ENTRIES = (
    _entry(16, DecodeLaunch(4, 32, 2, 2)),
    _entry(64, DecodeLaunch(2, 64, 4, 3, mma=False, heads_first=True)),
    _entry(256, DecodeLaunch(1, 16, 2, 2, heads_first=True)),
    _entry(32, DecodeLaunch(1, 128, 8), head_dim=128),  # another geometry: never chosen for 256-dim heads
    _entry(32, DecodeLaunch(1, 16, 4, 2, mma=False), head_dim=96, num_kv_heads=32, group=1),
)


@pytest.mark.parametrize("num_seqs, expected", [
    (16, 16), (1, 16), (20, 16), (32, 64),  # 32: 16 and 64 are both a factor 2 away: the larger
    (45, 64), (46, 64), (64, 64), (100, 64), (128, 256), (127, 64), (4096, 256)])
def test_the_nearest_entry_in_log2_sequences_ties_to_the_larger(num_seqs, expected):
    assert nearest_entry(ENTRIES, num_seqs, 8, 256, 2).num_seqs == expected
    assert nearest_entry(ENTRIES, num_seqs, 8, 256, 4) is None  # another group
    assert nearest_entry(ENTRIES, num_seqs, 4, 256, 2) is None  # other KV heads


def test_split_scaling_keeps_the_measured_programs_rounded_in_log2_and_clamped():
    assert scaled_splits(2, 32, 32) == 2
    assert scaled_splits(2, 32, 64) == 1
    assert scaled_splits(2, 32, 16) == 4
    assert scaled_splits(2, 32, 48) == 1  # 1.33: nearer 1 than 2 in log2
    assert scaled_splits(4, 32, 48) == 2  # 2.67: log2 1.42
    assert scaled_splits(1, 32, 22) == 2  # 1.45: log2 0.54
    assert scaled_splits(1, 256, 2) == 32  # 128: clamped
    assert scaled_splits(1, 256, 0) == 32  # an empty batch counts as one sequence
    assert scaled_splits(1, 1, 4096) == 1
    for splits, seqs, n in itertools.product((1, 2, 4, 8), (1, 3, 16, 32, 100, 256), range(1, 600, 7)):
        ratio = splits * seqs / n
        assert scaled_splits(splits, seqs, n) == min(32, max(1, 2 ** round(math.log2(ratio)))), (splits, seqs, n)


def test_a_table_launch_is_the_nearest_entrys_tile_with_scaled_or_explicit_splits():
    tile = DecodeLaunch(2, 64, 4, 3, mma=False, heads_first=True)
    assert launch_from_table(ENTRIES, 64, 8, 256, group=2) == tile
    assert launch_from_table(ENTRIES, 32, 8, 256, group=2) == DecodeLaunch(4, 64, 4, 3, False, True)  # 64 x 2 / 32
    assert launch_from_table(ENTRIES, 100, 8, 256, group=2) == DecodeLaunch(1, 64, 4, 3, False, True)
    assert launch_from_table(ENTRIES, 8, 8, 256, group=2) == DecodeLaunch(8, 32, 2, 2)  # the 16-seq entry: 4 x 2
    assert launch_from_table(ENTRIES, 8, 8, 256, 16, group=2) == DecodeLaunch(16, 32, 2, 2)  # the caller's splits
    assert launch_from_table(ENTRIES, 64, 8, 256, 1, group=2) == DecodeLaunch(1, 64, 4, 3, False, True)
    assert launch_from_table(ENTRIES, 16, 32, 96, group=1) == DecodeLaunch(2, 16, 4, 2, False)


def _todays_heuristic(num_seqs, num_kv_heads, head_dim, num_splits=None):
    """default_launch's rules without a table entry (commit 5f5654f's; c7ac56f's short tiles for >= 1,024
    programs were taken back on 2026-12-02: slower on ragged batches; from 4,096 programs, one split's 64-key
    tiles, KV heads first: 2026-12-05), verbatim."""
    import triton

    splits = 1
    while splits < 32 and num_seqs * num_kv_heads * splits < 256:
        splits *= 2
    num_splits = num_splits or splits
    narrow = max(1, triton.next_power_of_2(head_dim) // 128)
    if num_splits == 1 and num_seqs * num_kv_heads >= 4096:
        return DecodeLaunch(1, max(16, 64 // narrow), 4, 2, heads_first=True)
    if num_splits == 1:
        return DecodeLaunch(1, max(16, 128 // narrow), 4)
    return DecodeLaunch(num_splits, max(16, 64 // narrow), 2)


def test_without_an_entry_the_launch_is_todays_heuristic():
    pytest.importorskip("triton")
    shipped = {(e.head_dim, e.num_kv_heads, e.group) for e in load_table()}
    shapes = itertools.product((1, 2, 3, 8, 16, 31, 32, 64, 128, 160, 256, 511, 512, 1024), (1, 2, 4, 8, 32, 64),
                               (16, 24, 64, 80, 96, 128, 200, 256), (None, 1, 2, 4, 32), (1, 2, 4, 8))
    for seqs, kv_heads, head_dim, splits, group in shapes:
        today = _todays_heuristic(seqs, kv_heads, head_dim, splits)
        assert launch_from_table((), seqs, kv_heads, head_dim, splits, group) == today
        assert launch_from_table(ENTRIES, seqs, kv_heads, head_dim, splits) == today  # no group: no look-up
        if (head_dim, kv_heads) not in {(256, 8), (128, 8), (96, 32)}:
            assert launch_from_table(ENTRIES, seqs, kv_heads, head_dim, splits, group) == today
        if (head_dim, kv_heads, group) not in shipped:
            assert default_launch(seqs, kv_heads, head_dim, splits, group) == today
        assert default_launch(seqs, kv_heads, head_dim, splits) == today


def test_the_shipped_table_loads_and_says_what_it_is():
    data = json.loads(TABLE_PATH.read_text())
    assert "decode_attention_sweep.py --write-table" in data["about"]
    assert len(load_table()) == len(data["entries"])


GOOD = {"head_dim": 256, "num_kv_heads": 8, "group": 2, "num_seqs": 32, "context": 768,
        "launch": asdict(DecodeLaunch(1, 64, 4, 2)), "us": 123.4, "default_us": 150.0, "device": "NVIDIA H200"}


@pytest.mark.parametrize("bad, key", [
    ({**GOOD, "num_seqs": 0}, "'num_seqs'"),
    ({**GOOD, "group": True}, "'group'"),  # a bool is not an int
    ({**GOOD, "us": "fast"}, "'us'"),
    ({**GOOD, "device": None}, "'device'"),
    ({**GOOD, "colour": "red"}, "'colour'"),
    ({k: v for k, v in GOOD.items() if k != "context"}, "'context'"),
    ({**GOOD, "launch": [1, 64, 4]}, "'launch'"),
    ({**GOOD, "launch": {**GOOD["launch"], "block_n": 48}}, "'launch.block_n'"),
    ({**GOOD, "launch": {**GOOD["launch"], "num_splits": 3}}, "'launch.num_splits'"),
    ({**GOOD, "launch": {k: v for k, v in GOOD["launch"].items() if k != "mma"}}, "'launch.mma'"),
    ({**GOOD, "launch": {**GOOD["launch"], "heads_per_program": 2}}, "'launch.heads_per_program'"),  # no such key
    ({**GOOD, "context": 512}, "'num_seqs'"),  # a second entry of entry 0's key and sequences
])
def test_a_malformed_entry_is_rejected_naming_the_file_entry_and_key(tmp_path, bad, key):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"about": "test", "entries": [GOOD, bad]}))
    with pytest.raises(ValueError) as e:
        load_table(path)
    assert str(path) in str(e.value) and "entry 1" in str(e.value) and key in str(e.value), e.value
    path = tmp_path / "good.json"
    path.write_text(json.dumps({"entries": [GOOD, {**GOOD, "num_seqs": 64}]}))
    assert [e.num_seqs for e in load_table(path)] == [32, 64]


def test_a_table_that_is_not_one_is_rejected(tmp_path):
    path = tmp_path / "launches.json"
    path.write_text(json.dumps([GOOD]))
    with pytest.raises(ValueError, match="not a launch table"):
        load_table(path)


TABLE_LAUNCH_INTERPRET_SCRIPT = """
import torch, sys
sys.path[:0] = ["tests", "tests/kernels"]
from test_kernels import _check_rope_attention
from test_decode_launch_table import _entry
from batchgen.kernels.attention.decode_launch import DecodeLaunch, launch_from_table
# GQA, 8 query heads on 2 KV heads of 32: each one-entry table's tile at its splits scaled to the batch
cases = [(2, DecodeLaunch(2, 32, 2, 2), 5, DecodeLaunch(1, 32, 2, 2)),  # 2 x 2 / 5 = 0.8: one split
         (8, DecodeLaunch(1, 16, 4, 3, mma=False, heads_first=True), 2, DecodeLaunch(4, 16, 4, 3, False, True)),
         (5, DecodeLaunch(2, 16, 2, None, heads_first=True), 5, DecodeLaunch(2, 16, 2, None, True, True))]
for entry_seqs, tile, seqs, expected in cases:
    launch = launch_from_table((_entry(entry_seqs, tile, 32, 2, 4),), seqs, 2, 32, group=4)
    assert launch == expected, launch
    _check_rope_attention("cpu", torch.float32, 1e-5, [1, 37, 0, 70, 16][:seqs], launch=launch)
# MHA on CUDA cores: 2 splits x 16 seqs / 4 = 8 splits
launch = launch_from_table((_entry(16, DecodeLaunch(2, 16, 2, 2, mma=False), 24, 4, 1),), 4, 4, 24, group=1)
assert launch == DecodeLaunch(8, 16, 2, 2, False, False), launch
_check_rope_attention("cpu", torch.float32, 1e-5, [1, 37, 0, 70], num_heads=4, num_kv_heads=4, head_dim=24,
                      launch=launch)
print("ok")
"""


def test_table_launches_match_the_reference_under_triton_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter(TABLE_LAUNCH_INTERPRET_SCRIPT)


# ---- bench/decode_attention_sweep.py: the table it writes, its compile workers ----

@pytest.fixture
def sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("decode_attention_sweep")


def _rows(geometry, head_dim, num_kv_heads, group, num_seqs, context, default_us, timings):
    """A shape's sweep rows: the heuristic's (marked default), then one per (launch, us) of `timings`."""
    base = dict(geometry=geometry, head_dim=head_dim, num_kv_heads=num_kv_heads, group=group, num_seqs=num_seqs,
                context=context)
    rows = [{**base, **asdict(DecodeLaunch(1, 64, 4)), "default": True, "us": default_us}]
    return rows + [{**base, **asdict(launch), "us": us} for launch, us in timings]


def test_the_sweep_ranks_launches_by_their_worst_ratio_over_each_contexts_fastest(sweep):
    short, long_ = DecodeLaunch(1, 32, 2, 2), DecodeLaunch(1, 128, 4)  # fast at short / at long contexts
    both = DecodeLaunch(1, 64, 4)  # the rows' heuristic: never the fastest, never far off
    rows = (_rows("llama-8b", 128, 8, 4, 256, 160, 50.0, [(short, 46.0), (long_, 58.0)])
            + _rows("llama-8b", 128, 8, 4, 256, 2048, 400.0, [(short, 480.0), (long_, 380.0)])
            + _rows("llama-8b", 128, 8, 4, 32, 768, 80.0, [(short, 70.0)]))  # one context: no ranking
    (group,) = sweep.across_contexts(rows)
    assert (group["num_seqs"], group["contexts"]) == (256, [160, 2048])
    assert [launch for launch, _, _ in group["ranking"]] == [both, long_, short]
    assert group["ranking"][0][2] == pytest.approx([50 / 46, 400 / 380])
    assert group["heuristic"] == both and group["heuristic_place"] == 0


def test_a_ragged_context_spreads_every_length_in_a_fixed_order_and_ranks_beside_uniform_ones(sweep):
    """A ragged shape ("32-3072") holds every length from LO to HI once per sequence, shuffled the same way in
    the compile workers and the timing process; it ranks launches with the uniform shapes but writes no table
    entry (an entry is keyed by one context)."""
    assert sweep.parse_context("768") == 768 and sweep.parse_context("32-3072") == "32-3072"
    assert sweep.parse_shape("256:32-3072") == (256, "32-3072")
    with pytest.raises(ValueError, match="is not SEQS:CONTEXT"):
        sweep.parse_shape("256x160")
    for bad in ("0", "x", "5-3", "3-", "-3", ""):
        with pytest.raises(ValueError, match="is not N or LO-HI"):
            sweep.parse_context(bad)
    lengths = sweep.context_lengths("32-3072", 256)
    assert sorted(lengths) == [32 + 3040 * i // 255 for i in range(256)] and lengths != sorted(lengths)
    assert lengths == sweep.context_lengths("32-3072", 256)
    inputs = sweep.build_inputs("llama-8b", 4, "10-40", dev="cpu")
    assert sorted(inputs.lens.tolist()) == [10, 20, 30, 40]
    assert inputs.kv_bytes() == 2 * 100 * 8 * 128 * 2  # K and V of every sequence's own length, bf16
    fp8 = sweep.build_inputs("llama-8b", 4, "10-40", dev="cpu", kv_dtype="fp8")  # engine.kv_cache_dtype fp8
    assert fp8.k.dtype == fp8.v.dtype == torch.float8_e4m3fn and fp8.kv_bytes() == inputs.kv_bytes() // 2
    short, long_ = DecodeLaunch(1, 32, 2, 2), DecodeLaunch(1, 128, 4)
    rows = (_rows("llama-8b", 128, 8, 4, 256, 2048, 400.0, [(short, 420.0), (long_, 380.0)])
            + _rows("llama-8b", 128, 8, 4, 256, "32-3072", 450.0, [(short, 460.0), (long_, 395.0)])
            + _rows("llama-8b", 128, 8, 4, 256, 160, 50.0, [(short, 46.0), (long_, 58.0)]))
    (group,) = sweep.across_contexts(rows)
    assert group["contexts"] == [160, "32-3072", 2048]  # by mean length
    entries, notes = sweep.merge_table([], rows, "NVIDIA H200")
    # one entry per (geometry, sequences): the last uniform shape's (160); the ragged one in between wrote none
    assert [(e["context"], e["launch"]["block_n"]) for e in entries] == [(160, 32)]
    assert any("32-3072: ragged, not a table entry" in n for n in notes)


def test_the_sweep_merges_a_shapes_fastest_launch_only_where_it_beats_the_heuristic_by_3_percent(sweep):
    fast, slow = DecodeLaunch(2, 32, 2, 2, mma=False, heads_first=True), DecodeLaunch(4, 32, 4, 3)
    old = [{**GOOD, "head_dim": 128, "group": 4},  # another geometry: kept
           {**GOOD, "context": 512},  # gemma2-9b at 32 seqs: replaced
           {**GOOD, "num_seqs": 256, "context": 160}]  # gemma2-9b at 256 seqs: dropped (the heuristic stays)
    rows = (_rows("gemma2-9b", 256, 8, 2, 32, 768, 150.0, [(fast, 120.0), (slow, 160.0)])
            + _rows("gemma2-9b", 256, 8, 2, 256, 512, 100.0, [(fast, 97.5), (slow, 130.0)])  # 2.5 %: not enough
            + _rows("phi3-mini", 96, 32, 1, 32, 768, 80.0, [(fast, 90.0)]))  # the heuristic is fastest
    entries, notes = sweep.merge_table(old, rows, "NVIDIA H200")
    assert entries == [old[0], {"head_dim": 256, "num_kv_heads": 8, "group": 2, "num_seqs": 32, "context": 768,
                                "launch": asdict(fast), "us": 120.0, "default_us": 150.0, "device": "NVIDIA H200"}]
    assert len(notes) == 3 and "replaces its entry at context 512" in notes[0]
    assert "heuristic stays (its entry at context 160 dropped)" in notes[1] and "heuristic stays" in notes[2]
    assert sweep.merge_table(entries, rows, "NVIDIA H200")[0] == entries  # merging again changes nothing
    # two shapes of one geometry and sequences: the later one's entry
    rows = (_rows("gemma2-9b", 256, 8, 2, 32, 768, 150.0, [(fast, 120.0)])
            + _rows("gemma2-9b", 256, 8, 2, 32, 1024, 200.0, [(slow, 150.0)]))
    entries = sweep.merge_table([], rows, "NVIDIA H200")[0]
    assert [(e["context"], e["launch"]["num_splits"]) for e in entries] == [(1024, 4)]
    with pytest.raises(ValueError, match="0 default rows"):
        sweep.merge_table([], rows[1:2], "NVIDIA H200")
    # a saved report (--from-report) of a sweep over an fp8 cache or contiguous blocks is not a table's measure
    for unlike in ({"kv_dtype": "fp8"}, {"blocks": "contiguous"}):
        with pytest.raises(ValueError, match="bf16 caches and scattered blocks"):
            sweep.merge_table([], [{**r, **unlike} for r in rows], "NVIDIA H200")


def test_the_sweep_writes_a_table_default_launch_accepts(sweep, tmp_path):
    path = str(tmp_path / "launches.json")
    table = sweep.read_table(path)  # none yet
    assert table["entries"] == [] and "--write-table" in table["about"]
    rows = _rows("gemma2-9b", 256, 8, 2, 32, 768, 150.0, [(DecodeLaunch(2, 32, 2, 2), 120.0)])
    table["entries"] = sweep.merge_table(table["entries"], rows, "NVIDIA H200")[0]
    sweep.write_table(path, table)
    assert load_table(path)[0].launch == DecodeLaunch(2, 32, 2, 2)
    assert sweep.read_table(path) == table
    with pytest.raises(ValueError, match="'launch.block_n'"):  # checked before the file changes
        sweep.write_table(path, {"entries": [{**table["entries"][0], "launch": {**GOOD["launch"], "block_n": 3}}]})
    assert sweep.read_table(path) == table


COMPILE_POOL_SCRIPT = """
import multiprocessing, sys
from concurrent.futures import ProcessPoolExecutor
sys.path.insert(0, "bench")
import decode_attention_sweep as sweep
from batchgen.kernels.attention.decode_launch import DecodeLaunch
# starcoder2-3b: 24 query heads on 2 KV heads of 128 (GQA): a launch whose splits are not a power of two fails
bad = DecodeLaunch(3, 16, 2)
candidates = [DecodeLaunch(1, 16, 2, 2), DecodeLaunch(2, 32, 2, 2, mma=False), bad]
with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
    failed = sweep.compile_in_pool(pool, 2, "starcoder2-3b", 2, 20, candidates, dev="cpu")
assert list(failed) == [bad] and "AssertionError" in failed[bad], failed
print("ok")
"""


def test_the_sweeps_compile_workers_run_every_candidate_and_report_the_failures_under_triton_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter(COMPILE_POOL_SCRIPT, hopper=False)  # spawned workers: plain interpreter


def test_the_sweeps_timed_calls_cycle_through_disjoint_copies_of_the_cache(sweep):
    """A timed graph of several calls must not re-read K/V still in L2: each call reads its own copy's blocks."""
    import torch

    inputs = sweep.build_inputs("starcoder2-3b", 3, 40, dev="cpu", copies=3)
    blocks_per_seq = -(-41 // sweep.BLOCK_SIZE)
    num_blocks = 3 * blocks_per_seq
    assert inputs.k.shape[0] == 3 * num_blocks
    for c, (table, slots) in enumerate(zip(inputs.tables, inputs.slots)):
        assert sorted(table.flatten().tolist()) == list(range(c * num_blocks, (c + 1) * num_blocks))
        assert torch.equal(slots // sweep.BLOCK_SIZE, table[:, 39 // sweep.BLOCK_SIZE].long())  # the new token's
    assert inputs.kv_bytes() == 2 * 3 * 40 * 2 * 128 * 2  # one call's K/V (2 KV heads of 128), not the copies'


def test_the_sweeps_contiguous_blocks_give_each_sequence_its_blocks_in_order_within_each_copy(sweep):
    """--blocks contiguous: a fresh engine's placement (sequence after sequence, each one's blocks in order), still
    one disjoint range of blocks a copy; the default stays scattered."""
    import torch

    inputs = sweep.build_inputs("starcoder2-3b", 3, 40, dev="cpu", copies=2, blocks="contiguous")
    blocks_per_seq = -(-41 // sweep.BLOCK_SIZE)
    num_blocks = 3 * blocks_per_seq
    for c, table in enumerate(inputs.tables):
        assert table.flatten().tolist() == list(range(c * num_blocks, (c + 1) * num_blocks))
    torch.manual_seed(0)
    scattered = sweep.build_inputs("starcoder2-3b", 8, 200, dev="cpu")
    assert scattered.tables[0].flatten().tolist() != sorted(scattered.tables[0].flatten().tolist())
    with pytest.raises(ValueError, match="'contigous' is not"):
        sweep.build_inputs("starcoder2-3b", 3, 40, dev="cpu", blocks="contigous")


def test_the_many_sequence_gpu_cases_run_both_heuristic_launches():
    """tests/kernels/test_kernels.py's 160- and 640-sequence Llama cases (8 KV heads of 128, group 4: no table
    entry) exercise the two one-split launches: 128 / 4 below LARGE_BATCH_PROGRAMS, 64 / 4 / 2 KV heads first from it."""
    from batchgen.kernels.attention.decode_launch import LARGE_BATCH_PROGRAMS

    assert 160 * 8 < LARGE_BATCH_PROGRAMS <= 640 * 8
    assert default_launch(160, 8, 128, group=4) == DecodeLaunch(1, 128, 4)
    assert default_launch(640, 8, 128, group=4) == DecodeLaunch(1, 64, 4, 2, heads_first=True)


def test_an_fp8_cache_takes_two_warps_at_the_large_batch_tile_and_a_bf16_cache_keeps_four():
    """The K/V element size picks the large-batch launch's warps (decode_launch.LARGE_BATCH_FP8_WARPS, measured
    over fp8 caches); below LARGE_BATCH_PROGRAMS, and with several splits, the launch does not depend on it."""
    from batchgen.kernels.attention.decode_launch import LARGE_BATCH_FP8_WARPS, heuristic_launch

    assert default_launch(640, 8, 128, group=4, kv_element_bytes=1) == \
        DecodeLaunch(1, 64, LARGE_BATCH_FP8_WARPS, 2, heads_first=True)
    assert default_launch(640, 8, 128, group=4, kv_element_bytes=2) == DecodeLaunch(1, 64, 4, 2, heads_first=True)
    for seqs, splits in ((160, None), (32, None), (640, 4)):
        assert heuristic_launch(seqs, 8, 128, splits, kv_element_bytes=1) == heuristic_launch(seqs, 8, 128, splits)

"""BlockManager on plain Python data: ref counts, prefix-cache hits, eviction order."""

from __future__ import annotations

import pytest

from batchgen.engine.block_manager import BlockManager


def _fill(bm: BlockManager, tokens: list[int]) -> list[int]:
    table: list[int] = []
    assert bm.ensure_capacity(table, len(tokens))
    bm.register_full_blocks(tokens, table, [], len(tokens))
    return table


def test_full_blocks_are_found_by_prefix_and_one_token_is_always_left_to_compute():
    bm = BlockManager(num_blocks=10, block_size=4)
    tokens = list(range(12))
    table = _fill(bm, tokens)
    assert bm.match_prefix(tokens) == table[:2]  # all 3 blocks cached, but the last token must be computed
    assert bm.match_prefix(tokens + [99]) == table
    assert bm.match_prefix([0, 1, 2, 3, 4, 5, 6, 99, 8]) == table[:1]
    assert bm.match_prefix([7] + tokens) == []


def test_partial_blocks_are_not_cached():
    bm = BlockManager(num_blocks=10, block_size=4)
    table: list[int] = []
    bm.ensure_capacity(table, 6)
    keys: list = []
    bm.register_full_blocks(list(range(6)), table, keys, 6)
    assert len(keys) == 1 and bm.match_prefix(list(range(10))) == table[:1]


def test_freed_cached_blocks_survive_until_reused_and_uncached_ones_go_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    cached = _fill(bm, [1, 2, 3, 4])  # 2 full blocks, hashed
    scratch: list[int] = []
    bm.ensure_capacity(scratch, 3)  # 2 blocks, unhashed
    bm.free(cached)
    bm.free(scratch)
    assert bm.num_free_blocks == 4
    fresh = bm.allocate(2)
    assert set(fresh) == set(scratch)  # uncached blocks reused before cached ones
    assert bm.match_prefix([1, 2, 3, 4, 5]) == cached
    bm.allocate(2)  # now the cached blocks are evicted
    assert bm.match_prefix([1, 2, 3, 4, 5]) == []


def test_shared_blocks_are_ref_counted():
    bm = BlockManager(num_blocks=4, block_size=2)
    table = _fill(bm, [1, 2, 3, 4])
    hits = bm.match_prefix([1, 2, 3, 4, 5])
    assert bm.can_allocate(hits, 2)
    assert not bm.can_allocate(hits, 3)
    bm.take_cached(hits)
    bm.free(table)
    assert bm.num_free_blocks == 2  # still held by the second user
    bm.free(hits)
    assert bm.num_free_blocks == 4
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(hits)


def test_ensure_capacity_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    table: list[int] = []
    assert bm.ensure_capacity(table, 8)
    assert not bm.ensure_capacity(table, 17)
    assert len(table) == 2 and bm.num_free_blocks == 1
    assert bm.ensure_capacity(table, 12) and len(table) == 3


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    tokens = list(range(12))
    _fill(bm, tokens)
    assert bm.match_prefix(tokens + [1]) == []

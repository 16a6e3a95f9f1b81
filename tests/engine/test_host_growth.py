"""The host's cost per engine step must not grow with the rows a run has processed. These tests check
the structure behind that (what is kept per row or per cached block, and for how long), not timings."""

from __future__ import annotations

import gc
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.engine import Engine
from batchgen.engine.request import Request
from batchgen.job.run import run_job
from batchgen.job.job_file import load_spec
from jobutil import TOPICS, write_job


def _stream_through(bm: BlockManager, num_seqs: int, blocks_per_seq: int, first_token: int) -> None:
    """Sequences of distinct token ids (ints above the small-int cache, so each is its own object) computed in
    full and freed, as a long run does: the prefix cache fills, then every new block evicts the oldest."""
    bs = bm.block_size
    for s in range(num_seqs):
        start = first_token + s * bs * blocks_per_seq
        tokens = list(range(start, start + bs * blocks_per_seq))
        table: list[int] = []
        assert bm.ensure_capacity(table, len(tokens))
        keys: list = []
        bm.register_full_blocks(tokens, table, keys, len(tokens))
        bm.free(table)


def test_a_cached_block_key_is_one_flat_untracked_object():
    bm = BlockManager(num_blocks=64, block_size=16)
    _stream_through(bm, num_seqs=40, blocks_per_seq=4, first_token=10**6)  # 160 blocks through 64: wraps
    assert len(bm._key_to_block) == 64
    for key, block in bm._key_to_block.items():
        assert bm._block_key[block] is key
        # the collector never scans it and it keeps nothing else alive (no token id ints, no parent key)
        assert not gc.is_tracked(key) and gc.get_referents(key) == []
    # right after registration too: a key never passes through the collector's young generation
    table: list[int] = []
    bm.ensure_capacity(table, 16)
    keys: list = []
    bm.register_full_blocks(list(range(5 * 10**6, 5 * 10**6 + 16)), table, keys, 16)
    assert len(keys) == 1 and not gc.is_tracked(keys[0])


def _traced_growth(enable_prefix_caching: bool, num_blocks: int, bs: int) -> tuple[int, int, int, int]:
    """Host memory held before, and after streaming enough sequences to fill the cache once, twice, three times."""
    tracemalloc.start()
    try:
        bm = BlockManager(num_blocks=num_blocks, block_size=bs, enable_prefix_caching=enable_prefix_caching)
        base = tracemalloc.get_traced_memory()[0]
        _stream_through(bm, num_seqs=num_blocks // 8, blocks_per_seq=8, first_token=10**6)
        full = tracemalloc.get_traced_memory()[0]
        _stream_through(bm, num_seqs=num_blocks // 8, blocks_per_seq=8, first_token=10**8)  # every block reused
        wrapped = tracemalloc.get_traced_memory()[0]
        _stream_through(bm, num_seqs=num_blocks // 8, blocks_per_seq=8, first_token=2 * 10**8)  # and again
        wrapped_twice = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(bm._key_to_block) == (num_blocks if enable_prefix_caching else 0)
    return base, full, wrapped, wrapped_twice


def test_host_memory_per_cached_block_is_small_and_bounded_by_the_cache():
    num_blocks, bs = 4096, 16
    base, full, wrapped, wrapped_twice = _traced_growth(True, num_blocks, bs)
    base_off, full_off, _, _ = _traced_growth(False, num_blocks, bs)  # the same stream without a prefix cache
    per_block = ((full - base) - (full_off - base_off)) / num_blocks
    # a key (169 bytes) and its dict entry; a (hash, tuple of 16 ints) key kept the ints alive: ~720 bytes
    assert per_block < 300, per_block
    # once the cache has wrapped (its dict at its final size), more rows hold no more memory
    assert wrapped_twice - wrapped < 0.01 * (full - base)


def test_a_run_keeps_per_row_state_bounded(tmp_path, tiny_model_dir, monkeypatch):
    """The real job path over many more rows than fit at once, with a KV cache that wraps: every container
    that lives for the run stays within what the engine's limits allow, whatever the row count."""
    rows = 240
    pq.write_table(pa.Table.from_pylist([{"id": f"row-{i:05d}", "topic": TOPICS[i % len(TOPICS)], "level": i}
                                         for i in range(rows)]), tmp_path / "rows.parquet")
    max_num_seqs, num_kv_blocks, rows_per_shard = 8, 48, 20
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.parquet", "key_column": "id"},
                    sampling={"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1},
                    engine={"max_num_seqs": max_num_seqs, "num_kv_blocks": num_kv_blocks},
                    output={"rows_per_shard": rows_per_shard})
    seen: dict[str, int] = {}
    steps = [0]
    step = Engine.step

    def measured_step(self):
        out = step(self)
        steps[0] += 1
        s, bm = self.scheduler, self.block_manager
        sizes = {"pending": len(self._pending), "waiting": len(s.waiting), "running": len(s.running),
                 "done": len(s._done), "in_flight": len(s._in_flight), "keys": len(bm._key_to_block)}
        if steps[0] % 40 == 0:  # every live Request is one the engine still holds
            sizes["requests"] = sum(type(o) is Request for o in gc.get_objects())
        for k, v in sizes.items():
            seen[k] = max(seen.get(k, 0), v)
        return out

    monkeypatch.setattr(Engine, "step", measured_step)
    from batchgen.output.shard_writer import ShardWriter

    add_row = ShardWriter.add_row

    def measured_add_row(self, key, sample_rows):
        add_row(self, key, sample_rows)
        seen["buffered"] = max(seen.get("buffered", 0), self.num_buffered_keys)

    monkeypatch.setattr(ShardWriter, "add_row", measured_add_row)
    # Requests other tests in this process left alive (pytest-xdist orders tests per worker): not this run's
    gc.collect()
    before = sum(type(o) is Request for o in gc.get_objects())
    result = run_job(load_spec(job), show_progress=False)
    assert result.rows_committed == rows
    lookahead = 2 * max_num_seqs  # the loop admits rows while fewer prompts than this are unfinished
    assert seen["pending"] <= lookahead and seen["running"] <= max_num_seqs
    assert seen["waiting"] <= lookahead and seen["in_flight"] <= 2 and seen["done"] <= lookahead
    assert 0 < seen["keys"] <= num_kv_blocks
    assert seen["requests"] - before <= lookahead  # a leak of one a row would reach ~240
    assert seen["buffered"] <= rows_per_shard + lookahead

"""BlockManager: the paged KV cache's bookkeeping. Pure Python.

Blocks are reference counted. A block whose tokens are all computed gets a hash chained on its prefix
(parent hash + its own token ids), and stays findable in the prefix cache after its last user frees it,
until it is reused for something else (least recently freed first). So a system prompt shared by
thousands of rows is computed once, and a preempted request often finds its own blocks again.

Invariants:
- a block is in `_free` iff its ref count is 0; block 0.. num_blocks-1 are all either free or referenced;
- `_key_to_block[k] == b` iff `_block_key[b] == k` (a cached block is never in two chains).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence

# A block's prefix-cache key: bytes holding the 64-bit hash of the parent block's key (0 for a sequence's first
# block), then the block's own token ids, little-endian int64. Exact on the block's own tokens; the prefix before
# it is represented by the parent key's hash (SipHash, keyed per process), so two different prefixes share a key
# only if those hashes collide (about 2^-64 per pair of prefixes ending in the same block of tokens).
# A key lives until its block is reused: a long run holds one per KV block (10^4-10^6 on a GPU). So it is one flat
# object (169 bytes at 16 tokens) that the cyclic garbage collector does not track and that keeps nothing else
# alive. The (hash, tuple of ints) key it replaces held ~800 bytes a block, kept the block's token id ints alive
# and passed twice per block through the collector's young generation: the host's time per step grew as the
# cache filled (tests/engine/test_host_growth.py).
BlockKey = bytes


def key_format(block_size: int) -> struct.Struct:
    """The packing of a block's key: the parent key's hash, then the block's `block_size` token ids."""
    return struct.Struct(f"<{block_size + 1}q")


def chain_key(parent: BlockKey | None, block_token_ids: Sequence[int], fmt: struct.Struct | None = None) -> BlockKey:
    """The prefix-cache key of a block whose predecessor has key `parent` (None for a sequence's first block)."""
    fmt = fmt or key_format(len(block_token_ids))
    return fmt.pack(0 if parent is None else hash(parent), *block_token_ids)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        self._key_to_block: dict[BlockKey, int] = {}
        self._key_format = key_format(block_size)
        # Free blocks in reuse order (front first). Uncached blocks go to the front, cached ones to the back.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_prefix_hit_tokens = 0  # over the engine's life, for stats and tests

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding a prefix of `token_ids`; at least one token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        bs, fmt = self.block_size, self._key_format
        hits: list[int] = []
        key = None
        for i in range((len(token_ids) - 1) // bs):  # keys are chained: the first miss ends the prefix
            key = chain_key(key, token_ids[i * bs : (i + 1) * bs], fmt)
            block = self._key_to_block.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- allocation ----------------------------------------------------------------------------
    def can_allocate(self, cached_blocks: Sequence[int], num_new_blocks: int) -> bool:
        """Whether taking `cached_blocks` (prefix hits) and `num_new_blocks` fresh blocks fits now."""
        num_revived = sum(1 for b in cached_blocks if self._ref_count[b] == 0)
        return num_new_blocks <= len(self._free) - num_revived

    def take_cached(self, cached_blocks: Sequence[int]) -> None:
        for b in cached_blocks:
            if self._ref_count[b] == 0:
                del self._free[b]
            self._ref_count[b] += 1
        self.num_prefix_hit_tokens += len(cached_blocks) * self.block_size

    def allocate(self, num_new_blocks: int) -> list[int]:
        if num_new_blocks > len(self._free):
            raise RuntimeError(f"allocate({num_new_blocks}) with {len(self._free)} free blocks")
        blocks = []
        for _ in range(num_new_blocks):
            b, _ = self._free.popitem(last=False)
            key = self._block_key[b]
            if key is not None:  # evict it from the prefix cache: its contents are about to change
                del self._key_to_block[key]
                self._block_key[b] = None
            self._ref_count[b] = 1
            blocks.append(b)
        return blocks

    def ensure_capacity(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow `block_table` in place to hold `num_tokens`; False (and no change) if blocks are short."""
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        block_table.extend(self.allocate(need))
        return True

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block; tail blocks become reusable before head blocks."""
        for b in reversed(block_table):
            self._ref_count[b] -= 1
            assert self._ref_count[b] >= 0, f"block {b} freed twice"
            if self._ref_count[b] == 0:
                self._free[b] = None
                if self._block_key[b] is None:
                    self._free.move_to_end(b, last=False)  # nothing worth keeping: reuse first

    # ---- prefix cache --------------------------------------------------------------------------
    def register_full_blocks(self, token_ids: Sequence[int], block_table: list[int], block_keys: list[BlockKey],
                             num_computed_tokens: int) -> None:
        """Make blocks now full of computed tokens findable. `block_keys` is the sequence's chain of keys
        for its leading blocks; it is extended in place (its length is the number of blocks handled)."""
        bs = self.block_size
        if not self.enable_prefix_caching or num_computed_tokens // bs <= len(block_keys):
            return  # the common case, every decode step: no block became full
        num_full = min(num_computed_tokens // bs, len(block_table))
        fmt = self._key_format
        for i in range(len(block_keys), num_full):
            key = chain_key(block_keys[-1] if block_keys else None, token_ids[i * bs : (i + 1) * bs], fmt)
            block_keys.append(key)
            b = block_table[i]
            if self._block_key[b] is None and key not in self._key_to_block:
                self._block_key[b] = key
                self._key_to_block[key] = b

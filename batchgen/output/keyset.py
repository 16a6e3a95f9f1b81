"""KeySet: a set of row keys in about 16 bytes per key, so resuming or checking duplicates over millions of
rows keeps host memory nearly flat. Keys are stored as 64-bit hashes (with the row position that first had
each) in sorted numpy arrays plus a small dict of recent additions; a false match needs a 64-bit collision
(about 1 in 10^7 for a billion keys)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import numpy as np

MERGE_EVERY = 65536  # recent additions kept in a dict before they are merged into the sorted arrays


def key_hash(key: Any) -> int:
    data = f"{type(key).__name__}:{key}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


class KeySet:
    def __init__(self) -> None:
        self._hashes = np.empty(0, dtype=np.int64)  # sorted
        self._positions = np.empty(0, dtype=np.int64)  # aligned with _hashes
        self._recent: dict[int, int] = {}

    @classmethod
    def from_keys(cls, keys: Iterable[Any]) -> KeySet:
        ks = cls()
        for k in keys:
            ks._recent.setdefault(key_hash(k), -1)
            if len(ks._recent) >= MERGE_EVERY:
                ks._merge()
        ks._merge()
        return ks

    def __len__(self) -> int:
        return len(self._hashes) + len(self._recent)

    def _find(self, h: int) -> int | None:
        if h in self._recent:
            return self._recent[h]
        i = int(np.searchsorted(self._hashes, h))
        if i < len(self._hashes) and self._hashes[i] == h:
            return int(self._positions[i])
        return None

    def __contains__(self, key: Any) -> bool:
        return self._find(key_hash(key)) is not None

    def add(self, key: Any, position: int = -1) -> int | None:
        """Add a key; if it was already present return the position recorded with it (-1 if unknown)."""
        h = key_hash(key)
        earlier = self._find(h)
        if earlier is not None:
            return earlier
        self._recent[h] = position
        if len(self._recent) >= MERGE_EVERY:
            self._merge()
        return None

    def _merge(self) -> None:
        if not self._recent:
            return
        hashes = np.fromiter(self._recent.keys(), dtype=np.int64, count=len(self._recent))
        positions = np.fromiter(self._recent.values(), dtype=np.int64, count=len(self._recent))
        all_h = np.concatenate([self._hashes, hashes])
        all_p = np.concatenate([self._positions, positions])
        order = np.argsort(all_h, kind="stable")
        self._hashes, self._positions = all_h[order], all_p[order]
        self._recent = {}

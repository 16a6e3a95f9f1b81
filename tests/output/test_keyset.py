"""KeySet behaves as a set of keys (with first positions) across merges."""

from __future__ import annotations

from batchgen.output import keyset
from batchgen.output.keyset import KeySet


def test_keyset_membership_and_first_positions_survive_merges(monkeypatch):
    monkeypatch.setattr(keyset, "MERGE_EVERY", 7)
    ks = KeySet()
    for i in range(50):
        assert ks.add(f"k{i}", i) is None
    assert ks.add(3, 99) is None  # int 3 and "3" are different keys
    assert ks.add("3", 100) is None
    assert len(ks) == 52
    assert ks.add("k10", 77) == 10 and ks.add("k49", 78) == 49
    assert "k0" in ks and "k50" not in ks and 3 in ks
    done = KeySet.from_keys([1, 2, "x"])
    assert 1 in done and "x" in done and "1" not in done and len(done) == 3

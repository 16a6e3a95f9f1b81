"""A position-keyed chained job's record of the upstream shards its positions stand for (output/upstream_order.py):
a resume is refused once a recorded shard moved or was generated again under its name; the upstream may grow at the
end; shards beyond source.limit and a downstream that committed nothing are never a reason to refuse."""

from __future__ import annotations

import pytest

from batchgen.errors import JobError
from batchgen.output import upstream_order

UP = [["data/part-w00000-000000.parquet", 4, "a" * 64], ["data/part-w00000-000001.parquet", 4, "b" * 64]]


def _committed(out) -> None:
    (out / "manifest").mkdir(exist_ok=True)
    (out / "manifest" / "w00000.jsonl").write_text('{"commit": 0}\n')


def test_the_upstream_may_grow_at_the_end(tmp_path):
    upstream_order.check_and_record(tmp_path, tmp_path / "up", UP[:1])
    _committed(tmp_path)
    upstream_order.check_and_record(tmp_path, tmp_path / "up", UP)  # grown: accepted and recorded
    assert upstream_order.refusal(tmp_path, tmp_path / "up", UP[:1]) is not None  # a record gone: refused


def test_a_shard_generated_again_under_its_name_is_a_move(tmp_path):
    upstream_order.check_and_record(tmp_path, tmp_path / "up", UP)
    _committed(tmp_path)
    again = [UP[0], [UP[1][0], 4, "c" * 64]]  # a repaired last record: the rerun reused its commit number
    with pytest.raises(JobError, match="the upstream's committed rows moved .*record 2"):
        upstream_order.check_and_record(tmp_path, tmp_path / "up", again)


def test_nothing_is_refused_before_the_downstream_committed(tmp_path):
    upstream_order.check_and_record(tmp_path, tmp_path / "up", UP)  # a run killed before its first commit
    moved = [UP[1], UP[0]]
    upstream_order.check_and_record(tmp_path, tmp_path / "up", moved)
    _committed(tmp_path)
    assert upstream_order.refusal(tmp_path, tmp_path / "up", moved) is None  # the new order is the record now


def test_shards_beyond_source_limit_may_move_and_a_lower_limit_resumes(tmp_path):
    upstream_order.check_and_record(tmp_path, tmp_path / "up", UP, limit=3)  # the first shard holds the 3 rows
    _committed(tmp_path)
    changed_beyond = [UP[0], [UP[1][0], 4, "d" * 64]]
    assert upstream_order.refusal(tmp_path, tmp_path / "up", changed_beyond) is None
    changed_within = [[UP[0][0], 4, "e" * 64], UP[1]]
    assert upstream_order.refusal(tmp_path, tmp_path / "up", changed_within) is not None
    upstream_order.check_and_record(tmp_path, tmp_path / "up", UP, limit=8)  # a higher limit: both shards recorded
    upstream_order.check_and_record(tmp_path, tmp_path / "up", UP, limit=2)  # then a lower one: still accepted,
    assert upstream_order.refusal(tmp_path, tmp_path / "up", changed_beyond) is not None  # the record kept both


def test_a_record_without_checksums_compares_by_name_and_rows(tmp_path):
    import json

    (tmp_path / "upstream_order.json").write_text(json.dumps({"shards": [e[:2] for e in UP]}))
    _committed(tmp_path)
    assert upstream_order.refusal(tmp_path, tmp_path / "up", UP) is None
    assert upstream_order.refusal(tmp_path, tmp_path / "up", [UP[1], UP[0]]) is not None

"""The parts of `--ray` that need no cluster: the unit feed hands out each dealt row once and reports a unit
only once all its rows are committed; a unit dealt again opens the source anew and refreshes the committed keys;
the cluster's resources bound the worker count with a message naming them; a fixed-partition worker and a Ray
job's workers never run on one output at once."""

from __future__ import annotations

import random

import pytest

from batchgen.config import JobSpec
from batchgen.errors import JobError
from batchgen.job.feed import WAIT
from batchgen.output.lock import WorkerLock, check_partition
from batchgen.ray.cluster import plan_workers
from batchgen.ray.units import Unit, UnitFeed, plan_units, unit_rows_for
from batchgen.sources.base import SourceRow


class _ListSource:
    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.opened = 0

    def __iter__(self):
        self.opened += 1
        return (SourceRow(i, {"x": i}) for i in range(self.num_rows))


def _feed(num_rows: int):
    source, refreshed = _ListSource(num_rows), []
    feed = UnitFeed()
    feed.attach(source, lambda: refreshed.append(True))
    return feed, source, refreshed


def test_units_cover_every_row_once_and_a_worker_share_is_cut_fine():
    for num_rows in (1, 7, 100, 12345):
        for unit_rows in (1, 3, 512):
            units = plan_units(num_rows, unit_rows)
            assert [p for u in units for p in range(u.start, u.stop)] == list(range(num_rows))
    assert unit_rows_for(100_000, 4) == 512 and unit_rows_for(10, 4) == 8 and unit_rows_for(3200, 2) == 50


def test_a_unit_is_reported_only_once_its_last_row_is_committed():
    feed, _, _ = _feed(10)
    assert feed.next_row() is WAIT  # nothing dealt yet
    feed.deal(plan_units(10, 5))
    rows = [feed.next_row() for _ in range(5)]
    assert [r.position for r in rows] == [0, 1, 2, 3, 4]
    feed.row_skipped(0)  # an earlier run's
    for r in rows[1:]:
        feed.row_handed(r.position)
    assert feed.poll()["done"] == []  # handed to the writer, not committed
    feed.committed(3)
    assert feed.poll()["done"] == []  # one of its rows is still buffered
    feed.committed(1)
    assert feed.next_row().position == 5  # unit 0 is read to its end only now
    assert feed.poll()["done"] == [0]
    feed.close()


def test_randomised_dealing_hands_every_row_once_and_reports_every_unit_once_after_its_commit():
    rng = random.Random(7)
    for trial in range(40):
        num_rows = rng.randint(1, 60)
        feed, _, _ = _feed(num_rows)
        units = plan_units(num_rows, rng.randint(1, 9))
        to_deal, seen, done = list(units), [], []
        handed_unit: list[int] = []  # the unit of each handed entry, in writer order
        num_committed = 0
        while True:
            if to_deal and rng.random() < 0.5:
                take = rng.randint(1, 3)
                feed.deal(to_deal[:take])
                to_deal = to_deal[take:]
                if not to_deal:
                    feed.close()
            row = feed.next_row()
            if row is None:
                break
            if row is not WAIT:
                seen.append(row.position)
                if rng.random() < 0.2:
                    feed.row_skipped(row.position)
                else:
                    feed.row_handed(row.position)
                    handed_unit.append(next(u.unit_id for u in units if u.start <= row.position < u.stop))
            if num_committed < len(handed_unit) and rng.random() < 0.3:
                n = rng.randint(1, len(handed_unit) - num_committed)
                feed.committed(n)
                num_committed += n
            for unit_id in feed.poll()["done"]:  # reported: none of its handed entries is still buffered
                assert unit_id not in handed_unit[num_committed:], trial
                done.append(unit_id)
        feed.committed(len(handed_unit) - num_committed)
        done += feed.poll()["done"]
        assert seen == list(range(num_rows)), trial
        assert sorted(done) == [u.unit_id for u in units], trial


def test_a_unit_dealt_again_reopens_the_source_and_refreshes_the_committed_keys():
    feed, source, refreshed = _feed(20)
    feed.deal([Unit(2, 10, 15)])
    assert [feed.next_row().position for _ in range(5)] == [10, 11, 12, 13, 14]
    feed.deal([Unit(0, 0, 5, recheck=True)])  # behind what was read: the source opens again
    assert feed.next_row().position == 0
    assert source.opened == 2 and refreshed == [True]


def _spec(device="auto", tp=1):
    return JobSpec.model_validate({"model": {"path": "m", "device": device}, "source": {"path": "rows.jsonl"},
                                   "prompt": {"template": "{{ x }}"},
                                   "engine": {"tensor_parallel_size": tp}})


class _Cluster:
    """What plan_workers asks of Ray: the cluster's totals, and its nodes (default: one node holding it all)."""

    def __init__(self, resources, nodes=None):
        self.resources = resources
        self.node_resources = nodes if nodes is not None else [resources]

    def cluster_resources(self):
        return self.resources

    def nodes(self):
        return [{"Alive": True, "Resources": r} for r in self.node_resources] + [{"Alive": False, "Resources": {"GPU": 8.0}}]


def test_the_worker_count_is_bounded_by_the_cluster_with_a_message_naming_what_it_has():
    gpus = _Cluster({"CPU": 32.0, "GPU": 4.0})
    assert plan_workers(gpus, _spec(), "auto") == (4, {"num_gpus": 1, "num_cpus": 1})
    assert plan_workers(gpus, _spec("cpu"), 3) == (3, {"num_cpus": 1})
    with pytest.raises(JobError, match=r"--workers 5 needs 5 GPUs \(one each\) but the Ray cluster has 4"):
        plan_workers(gpus, _spec(), 5)
    with pytest.raises(JobError, match=r"model.device is 'cuda' but the Ray cluster has no GPU \(it has 8 CPUs\)"):
        plan_workers(_Cluster({"CPU": 8.0}), _spec("cuda"), 2)
    assert plan_workers(_Cluster({"CPU": 8.0}), _spec(), "auto") == (8, {"num_cpus": 1})


def test_a_tensor_parallel_worker_counts_only_the_gpus_it_finds_together_on_one_node():
    three_nodes = _Cluster({"CPU": 96.0, "GPU": 7.0}, [{"CPU": 32.0, "GPU": 4.0}, {"CPU": 32.0, "GPU": 2.0},
                                                       {"CPU": 32.0, "GPU": 1.0}])
    assert plan_workers(three_nodes, _spec(tp=2), "auto") == (3, {"num_gpus": 1, "num_cpus": 1})  # 2 + 1 + 0
    assert plan_workers(three_nodes, _spec(tp=4), "auto") == (1, {"num_gpus": 1, "num_cpus": 1})
    with pytest.raises(JobError, match=r"--workers 4 with engine.tensor_parallel_size 2 needs 4 nodes' worth of 2 "
                                       r"GPUs on one node each, but the Ray cluster's nodes have 4, 2, 1 GPUs: room "
                                       r"for 3"):
        plan_workers(three_nodes, _spec(tp=2), 4)
    with pytest.raises(JobError, match=r"tensor_parallel_size 8 needs 8 GPUs on one node for a worker; its nodes "
                                       r"have 4, 2, 1"):
        plan_workers(three_nodes, _spec(tp=8), "auto")
    assert plan_workers(_Cluster({"CPU": 5.0}), _spec("cpu", tp=2), "auto") == (2, {"num_cpus": 1})  # CPU ranks


def test_a_fixed_partition_worker_and_a_ray_job_never_share_an_output(tmp_path):
    ray_worker = WorkerLock(tmp_path, "w00000", dealer="ray host:1")
    same_dealer = WorkerLock(tmp_path, "w00001", dealer="ray host:1")
    check_partition(tmp_path, same_dealer)  # one dealer's workers: fine
    static = WorkerLock(tmp_path, "w00002", count=3, unit_rows=4)
    with pytest.raises(JobError, match="its rows dealt by ray host:1, not by a fixed partition"):
        check_partition(tmp_path, static)
    other_driver = WorkerLock(tmp_path, "w00003", dealer="ray host:2")
    with pytest.raises(JobError, match="two dealers at once would generate some rows twice"):
        check_partition(tmp_path, other_driver)
    for lock in (ray_worker, same_dealer, static, other_driver):
        lock.remove()


def test_a_worker_that_cannot_see_the_output_directory_stops_the_job_with_one_clear_error(tmp_path):
    from batchgen.ray.worker import RayWorker

    spec = _spec().model_copy(update={"output": _spec().output.model_copy(update={"dir": str(tmp_path / "elsewhere")})})
    worker = RayWorker(spec.model_dump(by_alias=True), 0, 1, "ray host:1")
    with pytest.raises(JobError, match=r"output directory .*elsewhere is not visible from the Ray node .*every node"):
        worker.run()
    assert not (tmp_path / "elsewhere").exists()


def _worker_in_a_thread(tmp_path, model_dir: str):
    """A RayWorker without Ray (its calls from threads) over a 6-row job that commits only when told to
    (rows_per_shard and commit_interval_s out of reach), its `run` started: (worker, thread, result, out)."""
    import threading

    from batchgen.job.job_file import load_spec
    from batchgen.output import layout
    from batchgen.ray.worker import RayWorker
    from jobutil import seed_rows, write_job, write_jsonl

    write_jsonl(tmp_path / "rows.jsonl", seed_rows(6))
    job = write_job(tmp_path, model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"temperature": 0.0, "max_new_tokens": 4}, engine={"max_num_seqs": 2},
                    output={"rows_per_shard": 1000, "commit_interval_s": 3600})
    out = tmp_path / "out"
    out.mkdir()
    layout.write_marker(out)
    worker = RayWorker(load_spec(job, [], str(out)).model_dump(by_alias=True), 0, 1, "ray host:1")
    result = {}
    thread = threading.Thread(target=lambda: result.update(worker.run()), daemon=True)
    thread.start()
    return worker, thread, result, out


def test_a_worker_out_of_dealt_rows_commits_them_at_once_so_the_dealer_can_end_the_job(tmp_path, tiny_model_dir):
    """A RayWorker (here without Ray: its calls from threads) whose engine has run out of dealt rows commits what
    it finished, though neither output.rows_per_shard nor output.commit_interval_s asks for it: the dealer
    counts a unit done at its commit and ends the job (or deals the rest) only then."""
    import time

    from jobutil import content_once

    worker, thread, result, out = _worker_in_a_thread(tmp_path, tiny_model_dir)
    units = plan_units(6, 4)
    worker.deal(units[:1])
    done, deadline = [], time.monotonic() + 120
    while len(done) < 1 and time.monotonic() < deadline and thread.is_alive():
        done += worker.poll()["done"]
        time.sleep(0.05)
    assert done == [0], "the unit's rows were not committed while the worker waited for more"
    assert len(content_once(out)) == 4
    worker.deal(units[1:])
    worker.finish()
    thread.join(timeout=120)
    assert result["rows_committed"] == 6 and len(content_once(out)) == 6


def test_a_model_the_driver_cannot_read_is_checked_by_each_tensor_parallel_worker_before_its_ranks_meet(tmp_path,
                                                                                                        monkeypatch):
    """The Ray driver may not see a model path local to the cluster's nodes: it skips the split checks then,
    and each worker's rank 0 makes them before joining its group (a JobError, which stops the job)."""
    import json
    from datetime import timedelta

    from batchgen.job import ranks
    from batchgen.ray import ranks as ray_ranks
    from batchgen.job.job_file import load_spec
    from batchgen.output import layout
    from batchgen.ray.worker import RayWorker
    from conftest import make_tokenizer
    from jobutil import seed_rows, write_job, write_jsonl

    write_jsonl(tmp_path / "rows.jsonl", seed_rows(2))
    missing = load_spec(write_job(tmp_path, str(tmp_path / "on-the-nodes"), {"path": "rows.jsonl"}),
                        ["engine.tensor_parallel_size=2"])
    ranks.check_before_launch(missing, model_elsewhere=True)  # not readable here: left to the workers
    with pytest.raises(JobError, match="model.path: no such folder .*on-the-nodes"):
        ranks.check_before_launch(missing)
    model = tmp_path / "m"  # a config with 3 attention heads, seen by the worker
    model.mkdir()
    make_tokenizer().save_pretrained(model)
    (model / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=48,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1)))
    out = tmp_path / "out"
    out.mkdir()
    layout.write_marker(out)
    spec = load_spec(write_job(tmp_path, str(model), {"path": "rows.jsonl"}), ["engine.tensor_parallel_size=2"],
                     str(out))
    worker = RayWorker(spec.model_dump(by_alias=True), 0, 1, "ray host:1")
    monkeypatch.setattr(ray_ranks, "RENDEZVOUS_TIMEOUT", timedelta(seconds=2))  # were it not refused: no long wait
    with pytest.raises(JobError, match=r"engine.tensor_parallel_size 2: .*num_attention_heads \(3\)"):
        worker.run("127.0.0.1:1")  # refused before it would wait for rank 1 there


def test_held_engine_error_rows_are_rejected_at_a_workers_idle_only_once_the_dealer_has_dealt_all(
        tmp_path, tiny_model_dir, monkeypatch):
    """Rows failed by an error of no known class are held (the engine's fault, or theirs: a later generated row
    tells). A worker idle for want of rows keeps holding them while the dealer has units left, so a broken
    engine still trips the breaker; once the dealer says it has dealt all, they are the job's tail and are
    rejected as at the end of a run."""
    import time

    from batchgen.engine import request as request_mod
    from batchgen.job.loop import IDLE_COMMIT_S
    from jobutil import content_once, read_rows

    append = request_mod.Request.append_token

    def failing(self, token_id):  # the first unit's four rows (the engine's first four requests) fail
        if self.request_id.split("#")[0] in {"req-0", "req-1", "req-2", "req-3"}:
            raise IndexError("injected bookkeeping failure")
        return append(self, token_id)

    monkeypatch.setattr(request_mod.Request, "append_token", failing)
    worker, thread, result, out = _worker_in_a_thread(tmp_path, tiny_model_dir)
    units = plan_units(6, 4)
    worker.deal(units[:1])
    deadline = time.monotonic() + 120
    while (worker.loop is None or len(worker.loop.held_engine_errors) < 4) and time.monotonic() < deadline:
        assert thread.is_alive(), result
        time.sleep(0.05)
    time.sleep(4 * IDLE_COMMIT_S)  # idle well past the commit point
    assert worker.poll()["done"] == [] and len(worker.loop.held_engine_errors) == 4
    worker.all_dealt()
    done = []
    while not done and time.monotonic() < deadline:
        done += worker.poll()["done"]
        time.sleep(0.05)
    assert done == [0]
    rejects = read_rows(out, "rejects")
    assert len(rejects) == 4 and {r["error_class"] for r in rejects} == {"engine_error"}
    worker.deal(units[1:])
    worker.finish()
    thread.join(timeout=120)
    assert result["rows_rejected"] == 4 and len(content_once(out)) == 2


def test_the_drivers_resume_check_leaves_a_model_it_cannot_read_to_the_workers(tmp_path):
    """A model path local to the cluster's nodes: the driver cannot load its config, so it does not refuse (the
    workers compare the fingerprint); an output without a fingerprint is never read further."""
    from batchgen.job.validate import refuse_changed_resume
    from batchgen.output.fingerprint import FILE

    (tmp_path / "rows.jsonl").write_text('{"id": "a", "topic": "tea"}\n')
    out = tmp_path / "out"
    spec = JobSpec.model_validate({"model": {"path": str(tmp_path / "only-on-the-nodes"), "device": "cpu"},
                                   "source": {"path": str(tmp_path / "rows.jsonl")},
                                   "prompt": {"template": "{{ topic }}"}, "output": {"dir": str(out)}})
    refuse_changed_resume(spec)  # no output yet
    out.mkdir()
    (out / FILE).write_text('{"fingerprint": "x", "components": {"sampling": {"max_new_tokens": 1}}}')
    refuse_changed_resume(spec)  # the model is not readable here: no refusal, no error

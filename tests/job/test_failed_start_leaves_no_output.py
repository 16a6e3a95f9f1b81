"""A run that fails before committing anything leaves nothing of itself in the output folder (docs/guide/resume.md):
no marker, lock, fingerprint, resolved job or empty batchgen folders, and no output folder it created, so a next
run with other sampling settings is not refused as a resume of an output that holds no row. What was there
before the run, what another worker still running uses, and whatever any worker committed, stays."""

from __future__ import annotations

import shutil

import pytest
import torch

from batchgen.output.lock import WorkerLock
from jobutil import invoke_run, read_rows, seed_rows, six_row_job, write_job, write_jsonl

_run = invoke_run


@pytest.fixture
def job(tmp_path, tiny_model_dir):
    return six_row_job(tmp_path, tiny_model_dir)


@pytest.fixture
def engine_fails(monkeypatch):
    """The engine cannot be built (out of memory: exit 2) until the returned function is called."""
    from batchgen.engine import engine as engine_module

    def no_memory(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(engine_module.Engine, "__init__", no_memory)
    return lambda: monkeypatch.undo()


def _contents(folder):
    """Every entry under `folder` (relative path: bytes of a file, None for a folder)."""
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes()) for p in sorted(folder.rglob("*"))}


def test_engine_failing_to_build_in_a_new_folder_leaves_no_folder_and_a_changed_job_runs(job, tmp_path, engine_fails):
    out = tmp_path / "new" / "out"
    failed = _run(job, "-o", out)
    assert failed.exit_code == 2, failed.output
    assert "out of memory while setting up the engine" in failed.output
    assert not (tmp_path / "new").exists()  # the output folder and the folder above it, both made by this run
    engine_fails()
    changed = _run(job, "-o", out, "--set", "sampling.temperature=0.7")
    assert changed.exit_code == 0, changed.output
    assert "refusing to resume" not in changed.output and len(read_rows(out)) == 6


def test_damaged_weights_found_at_the_first_row_leave_no_folder(job, tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:len(good) // 3])  # the weights load lazily, when the first row needs the engine
    job = write_job(tmp_path, str(model), {"path": "rows.jsonl", "key_column": "id"})
    failed = _run(job)
    assert failed.exit_code == 2, failed.output
    assert "is damaged or not a safetensors file" in failed.output
    assert not (tmp_path / "out").exists()
    weights.write_bytes(good)
    changed = _run(job, "--set", "sampling.temperature=0.7")
    assert changed.exit_code == 0, changed.output
    assert len(read_rows(tmp_path / "out")) == 6


def test_duplicate_key_before_any_commit_leaves_no_folder(tmp_path, tiny_model_dir):
    rows = seed_rows(6)
    rows[3]["id"] = rows[1]["id"]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"})
    failed = _run(job)
    assert failed.exit_code == 2 and "duplicate key 'row-0001' (rows 1 and 3)" in failed.output, failed.output
    assert not (tmp_path / "out").exists()
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(6))
    assert _run(job, "--set", "sampling.temperature=0.7").exit_code == 0


def test_a_folder_that_existed_keeps_what_it_held_and_only_that(job, tmp_path, engine_fails):
    out = tmp_path / "out"
    (out / "notes").mkdir(parents=True)
    (out / "keep.txt").write_text("mine\n")
    before = _contents(out)
    failed = _run(job, "-o", out)
    assert failed.exit_code == 2, failed.output
    assert _contents(out) == before
    engine_fails()
    assert _run(job, "-o", out, "--set", "sampling.temperature=0.7").exit_code == 0


def test_a_resume_that_fails_leaves_the_committed_output_as_it_was(job, tmp_path, monkeypatch):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(4))
    assert _run(job).exit_code == 0
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(8))  # four more rows: the resume needs the engine
    out = tmp_path / "out"
    before = _contents(out)
    assert len(read_rows(out)) == 4
    from batchgen.engine import engine as engine_module

    def no_memory(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(engine_module.Engine, "__init__", no_memory)
    failed = _run(job)
    assert failed.exit_code == 2, failed.output
    assert _contents(out) == before  # every file there before, unchanged; nothing added (no lock file either)


def test_a_lone_worker_that_committed_before_finding_a_duplicate_keeps_its_output(tmp_path, tiny_model_dir):
    rows = seed_rows(10)
    rows[9]["id"] = rows[1]["id"]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    engine={"max_num_seqs": 1}, output={"rows_per_shard": 1})
    failed = _run(job)
    assert failed.exit_code == 2 and "duplicate key 'row-0001' (rows 1 and 9)" in failed.output, failed.output
    out = tmp_path / "out"
    committed = read_rows(out)
    assert committed and len({r["id"] for r in committed}) == len(committed)
    for name in (".batchgen", "fingerprint.json", "job.resolved.yaml", "manifest/w00000.jsonl"):
        assert (out / name).is_file(), name
    rows[9]["id"] = "row-0009"
    write_jsonl(tmp_path / "rows.jsonl", rows)
    again = _run(job)  # resumes what was committed (a changed sampling setting would be refused)
    assert again.exit_code == 0 and f"{len(committed)} already done" in again.output, again.output
    assert len(read_rows(out)) == 10


def test_nothing_a_running_worker_uses_is_removed(job, tmp_path, engine_fails):
    out = tmp_path / "out"
    out.mkdir()
    other = WorkerLock(out, "w00001")  # another worker of this output, running
    try:
        failed = _run(job, "-o", out)
        assert failed.exit_code == 2, failed.output
        for name in (".batchgen", "fingerprint.json", "job.resolved.yaml", ".lock-w00001"):
            assert (out / name).is_file(), name
        for name in ("data", "rejects", "manifest", "logs"):
            assert (out / name).is_dir(), name
    finally:
        other.remove()


def test_a_fresh_start_that_fails_leaves_no_half_made_output_under_the_old_names(job, tmp_path, monkeypatch):
    assert _run(job).exit_code == 0  # an output: fingerprint, resolved job, shards, manifest, reports
    out = tmp_path / "out"
    from batchgen.engine import engine as engine_module

    def no_memory(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(engine_module.Engine, "__init__", no_memory)
    failed = _run(job, "--fresh", "--set", "sampling.temperature=0.7")
    assert failed.exit_code == 2, failed.output
    left = sorted(p.name for p in out.iterdir())
    assert left in ([], [".batchgen"]), left  # the old output went (as asked); nothing of the failed start stays
    monkeypatch.undo()
    changed = _run(job, "--set", "sampling.temperature=0.9")  # a new start, not a refused resume
    assert changed.exit_code == 0 and "refusing to resume" not in changed.output, changed.output
    assert len(read_rows(out)) == 6

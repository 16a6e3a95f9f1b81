"""`batchgen verify` finds every kind of damage and names it; `batchgen repair` rebuilds what can be rebuilt,
quarantines the rest (deleting nothing), and the next run brings the output back to the undamaged run's rows,
exactly once. Ends with a seeded fault campaign: random single-byte damage and deletions."""

from __future__ import annotations

import json
import os
import random
import time

import pytest

from batchgen.output.lock import WorkerLock
from integrityutil import cli, content, copy_output, make_reference, manifest_lines, reject_keys, write_manifest

CAMPAIGN_SEED = int(os.environ.get("BATCHGEN_CAMPAIGN_SEED", "39"))  # another seed: another campaign
CAMPAIGN_BUDGET_S = 45  # trials stop starting after this (each ~1-3 s on 2 cores)
CAMPAIGN_MAX_TRIALS = 60


@pytest.fixture(scope="module")
def ref(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("verify")
    job, out = make_reference(tmp, tiny_model_dir)
    return job, out, content(out), reject_keys(out)


def _repair_then_resume(job, out, rows, rejects) -> str:
    repaired = cli("repair", str(out))
    assert repaired.exit_code == 0, repaired.output
    assert "intact" in repaired.output
    resumed = cli("run", str(job), "-o", str(out))
    assert resumed.exit_code == 0, resumed.output
    assert content(out) == rows and reject_keys(out) == rejects
    assert cli("verify", str(out)).exit_code == 0
    return repaired.output


def test_verify_of_an_intact_output_exits_0_with_a_summary(ref):
    _, out, _, _ = ref
    result = cli("verify", str(out))
    assert result.exit_code == 0, result.output
    assert "intact" in result.output and "SHA-256" in result.output


def test_verify_lists_every_file_batchgen_did_not_write_and_touches_none(ref, tmp_path):
    _, reference, _, _ = ref
    out = copy_output(reference, tmp_path / "out")
    mine = {"notes.txt": b"mine", "manifest/w00000.jsonl.bak": b"copy", "data/holiday.jpg": b"jpg"}
    for rel, data in mine.items():
        (out / rel).write_bytes(data)
    (out / "drafts").mkdir()
    result = cli("verify", str(out))
    assert result.exit_code == 0 and "intact" in result.output, result.output
    assert ("4 files batchgen did not write (never touched): data/holiday.jpg, drafts/, manifest/w00000.jsonl.bak, "
            "notes.txt") in result.output
    assert {rel: (out / rel).read_bytes() for rel in mine} == mine


def test_verify_lists_every_damage_naming_files_and_lines_and_exits_2(ref, tmp_path):
    _, reference, _, _ = ref
    out = copy_output(reference, tmp_path / "out")
    lines = manifest_lines(out)
    lines[0] = lines[0][:-3] + b"x" + lines[0][-2:]  # a checksum digit
    write_manifest(out, lines + [lines[2]])  # and a record twice
    shards = sorted((out / "data").glob("*.parquet"))
    shards[-1].unlink()
    (out / "data" / "stray.bin").write_bytes(b"user file")
    result = cli("verify", str(out))
    assert result.exit_code == 2
    for named in ("manifest/w00000.jsonl line 1", f"manifest/w00000.jsonl line {len(lines) + 1}",
                  f"data/{shards[-1].name}: missing", "data/stray.bin", "batchgen repair"):
        assert named in result.output, (named, result.output)


def test_repair_rebuilds_a_damaged_records_line_from_its_intact_shard_and_nothing_is_generated_again(ref, tmp_path):
    job, reference, rows, rejects = ref
    out = copy_output(reference, tmp_path / "out")
    lines = manifest_lines(out)
    lines[1] = lines[1].replace(b'"num_rows":3', b'"num_rows":4')
    write_manifest(out, lines)
    said = _repair_then_resume(job, out, rows, rejects)
    assert "recorded" in said and "SHA-256" in said
    assert list((out / "quarantine").rglob("w00000.jsonl")), "the damaged manifest is kept in quarantine"
    assert "0 rows committed" in cli("run", str(job), "-o", str(out)).output


def test_repair_quarantines_a_garbled_shard_and_the_next_run_regenerates_its_rows(ref, tmp_path):
    job, reference, rows, rejects = ref
    out = copy_output(reference, tmp_path / "out")
    shard = sorted((out / "data").glob("*.parquet"))[1]
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    said = _repair_then_resume(job, out, rows, rejects)
    assert "dropped" in said or "rebuilt" in said
    assert "rows that were dropped" in said and "files are in" in said
    assert [p.read_bytes() for p in (out / "quarantine").rglob(shard.name)] == [bytes(data)]


def test_repair_drops_a_duplicated_record_and_keeps_its_shard(ref, tmp_path):
    job, reference, rows, rejects = ref
    out = copy_output(reference, tmp_path / "out")
    lines = manifest_lines(out)
    write_manifest(out, lines + [lines[0]])
    write_manifest(out, [lines[1]], tag="w00001")
    said = _repair_then_resume(job, out, rows, rejects)
    assert said.count("batchgen: dropped") == 2
    assert (out / json.loads(lines[0])["data"]).exists()
    # w00001 held only the duplicate: its manifest moved aside whole, no empty one left to read as a worker
    assert not (out / "manifest" / "w00001.jsonl").exists()
    assert [p.read_bytes() for p in (out / "quarantine").rglob("w00001.jsonl")] == [lines[1] + b"\n"]


def test_repair_rebuilds_a_deleted_manifest_from_its_shards(ref, tmp_path):
    job, reference, rows, rejects = ref
    out = copy_output(reference, tmp_path / "out")
    (out / "manifest" / "w00000.jsonl").unlink()
    result = cli("verify", str(out))
    assert result.exit_code == 2 and "manifest/w00000.jsonl: missing" in result.output
    said = _repair_then_resume(job, out, rows, rejects)
    assert "Parquet page checksums only" in said  # no record held their hashes: said so
    # nothing was moved aside and no row dropped: repair names no quarantine folder and asks for no rerun
    assert not (out / "quarantine").exists()
    assert "quarantine" not in said and "rows that were dropped" not in said


def test_repair_refuses_while_a_run_holds_a_workers_lock(ref, tmp_path):
    _, reference, _, _ = ref
    out = copy_output(reference, tmp_path / "out")
    write_manifest(out, manifest_lines(out)[1:])
    lock = WorkerLock(out, "w00000")
    try:
        result = cli("repair", str(out))
    finally:
        lock.release()
    assert result.exit_code == 2 and "another batchgen run" in result.output
    assert not (out / "quarantine").exists()


def _damage(rng: random.Random, out) -> str:
    """One random fault to a committed file; returns the file's relative path."""
    folder = rng.choices(["manifest", "data", "rejects"], weights=[2, 2, 1])[0]  # the one manifest: often
    rel = rng.choice(sorted(f"{folder}/{p.name}" for p in (out / folder).glob("*") if p.is_file()))
    path = out / rel
    if rng.random() < 0.25:
        path.unlink()
        return rel
    data = bytearray(path.read_bytes())
    at = rng.randrange(len(data))
    data[at] = rng.choice([b for b in range(256) if b != data[at]])
    path.write_bytes(bytes(data))
    return rel


def test_fault_campaign_random_byte_damage_and_deletion_then_verify_repair_resume_equals_the_undamaged_run(
        ref, tmp_path):
    job, reference, rows, rejects = ref
    rng = random.Random(CAMPAIGN_SEED)
    started = time.monotonic()
    outcomes = []
    for trial in range(CAMPAIGN_MAX_TRIALS):
        if time.monotonic() - started > CAMPAIGN_BUDGET_S:
            break
        out = copy_output(reference, tmp_path / f"trial{trial}")
        rel = _damage(rng, out)
        verified = cli("verify", str(out))
        fault = "deleted" if not (out / rel).exists() else "byte"
        # every fault is found and named (a deleted shard by its name; a deleted manifest too)
        assert verified.exit_code == 2, (trial, rel, verified.output)
        assert rel in verified.output, (trial, rel, verified.output)
        repaired = cli("repair", str(out))
        if repaired.exit_code != 0:  # refusing is allowed, naming the file
            assert repaired.exit_code == 2 and rel in repaired.output, (trial, rel, repaired.output)
            outcomes.append((rel, f"{fault}, refused"))
            continue
        resumed = cli("run", str(job), "-o", str(out))
        assert resumed.exit_code == 0, (trial, rel, resumed.output)
        assert content(out) == rows, (trial, rel)
        assert reject_keys(out) == rejects, (trial, rel)
        outcomes.append((rel, fault))
    assert len(outcomes) >= 8, outcomes
    assert sum(o.endswith("refused") for _, o in outcomes) <= len(outcomes) // 4, outcomes
    print(f"campaign: {len(outcomes)} trials in {time.monotonic() - started:.1f} s: {outcomes}")

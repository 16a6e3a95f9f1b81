"""A verifiable output directory: damage to committed files stops every reader (run, status, export, report, a
chained job's source) with exit 2 naming the file and line, deletes nothing; only a torn last manifest line is not
committed. Each test damages a copy of one finished output."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.output.damage import OutputDamaged
from batchgen.sources import open_source
from batchgen.config import SourceSpec
from integrityutil import (cli, content, copy_output, listing, make_reference, manifest_lines,
                           write_manifest)
from jobutil import write_job


@pytest.fixture(scope="module")
def ref(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("integrity")
    job, out = make_reference(tmp, tiny_model_dir)
    return job, out, content(out)


def _readers_refuse(job, out, named: str) -> None:
    """status, export, report and run each exit 2 naming `named`, pointing at verify/repair, deleting nothing."""
    before = {p: (out / p).read_bytes() for p in listing(out) if not p.startswith(("logs/", "reports/"))}
    for args in (("status", str(out)), ("export", str(out), "--to", str(out.parent / f"{out.name}.jsonl")),
                 ("report", str(out)), ("run", str(job), "-o", str(out))):
        result = cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert named in result.output and "batchgen repair" in result.output, (args, result.output)
        assert "run the same command again" not in result.output
    assert {p: (out / p).read_bytes() for p in before} == before, "a reader changed or deleted a committed file"
    assert not (out.parent / f"{out.name}.jsonl").exists()


def test_a_damaged_middle_manifest_record_stops_every_reader_and_names_the_line(ref, tmp_path):
    job, reference, _ = ref
    out = copy_output(reference, tmp_path / "out")
    lines = manifest_lines(out)
    lines[1] = b"[" + lines[1][1:]  # one byte at the start of the second record
    write_manifest(out, lines)
    _readers_refuse(job, out, "manifest/w00000.jsonl line 2")


def test_a_changed_byte_in_a_records_key_list_is_detected_not_generated_twice(ref, tmp_path):
    job, reference, _ = ref
    out = copy_output(reference, tmp_path / "out")
    lines = manifest_lines(out)
    lines[0] = lines[0].replace(b'"row-0001"', b'"row-0901"')  # still valid JSON: only the checksum can tell
    write_manifest(out, lines)
    _readers_refuse(job, out, "manifest/w00000.jsonl line 1")


@pytest.mark.parametrize("where", [0, 2])
def test_a_nul_line_in_the_manifest_names_file_and_line_without_a_unicode_error(ref, tmp_path, where):
    job, reference, _ = ref
    out = copy_output(reference, tmp_path / "out")
    lines = manifest_lines(out)
    lines.insert(where, b"\x00" * 64)
    write_manifest(out, lines)
    _readers_refuse(job, out, f"manifest/w00000.jsonl line {where + 1}")


def test_a_record_without_keys_is_exit_2_naming_the_line(ref, tmp_path):
    job, reference, _ = ref
    out = copy_output(reference, tmp_path / "out")
    lines = manifest_lines(out)
    record = json.loads(lines[1])
    legacy = {k: v for k, v in record.items() if k not in ("check", "files", "keys")}  # an old-format line
    lines[1] = json.dumps(legacy, separators=(",", ":")).encode()
    write_manifest(out, lines)
    result = cli("status", str(out))
    assert result.exit_code == 2 and "manifest/w00000.jsonl line 2" in result.output and "`keys`" in result.output


def test_a_torn_last_line_of_nul_bytes_is_not_committed_and_the_run_resumes_exactly_once(ref, tmp_path):
    job, reference, rows = ref
    out = copy_output(reference, tmp_path / "out")
    lines = manifest_lines(out)
    last = json.loads(lines[-1])
    write_manifest(out, lines[:-1])
    manifest = out / "manifest" / "w00000.jsonl"
    manifest.write_bytes(manifest.read_bytes() + b"\x00" * 100)  # a power loss: the size grew, the data did not
    assert cli("status", str(out)).exit_code == 0  # the uncommitted tail is not damage
    done = cli("run", str(job), "-o", str(out))
    assert done.exit_code == 0, done.output
    assert f"{len(last['keys'])} rows committed" in done.output
    assert content(out) == rows and b"\x00" not in manifest.read_bytes()


def test_a_whole_last_record_missing_only_its_newline_stays_committed(ref, tmp_path):
    job, reference, rows = ref
    out = copy_output(reference, tmp_path / "out")
    write_manifest(out, manifest_lines(out), end=b"")  # a crash after the record's bytes, before its newline
    done = cli("run", str(job), "-o", str(out))
    assert done.exit_code == 0 and "0 rows committed" in done.output, done.output
    assert content(out) == rows
    assert (out / "manifest" / "w00000.jsonl").read_bytes().endswith(b"}\n")


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_truncated_or_deleted_shard_stops_every_reader_naming_it(ref, tmp_path, damage):
    job, reference, _ = ref
    out = copy_output(reference, tmp_path / "out")
    shard = sorted((out / "data").glob("*.parquet"))[1]
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    else:
        shard.unlink()
    _readers_refuse(job, out, f"data/{shard.name}")


def test_a_garbled_shard_of_the_same_size_stops_export_and_a_chained_source_naming_it(ref, tmp_path):
    job, reference, _ = ref
    out = copy_output(reference, tmp_path / "out")
    shard = sorted((out / "rejects").glob("*.parquet"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    result = cli("export", str(out), "--format", "openai", "--to", str(tmp_path / "e.jsonl"))
    assert result.exit_code == 2 and f"rejects/{shard.name}" in result.output and "SHA-256" in result.output
    data_shard = sorted((out / "data").glob("*.parquet"))[0]
    raw = bytearray(data_shard.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data_shard.write_bytes(bytes(raw))
    with pytest.raises(OutputDamaged, match=f"data/{data_shard.name}"):
        list(open_source(SourceSpec(path=str(out), type="batchgen_output")))


def test_a_record_duplicated_by_hand_is_detected_and_never_exported_twice(ref, tmp_path):
    job, reference, _ = ref
    out = copy_output(reference, tmp_path / "out")
    lines = manifest_lines(out)
    write_manifest(out, lines + [lines[1]])  # the same record twice in one manifest
    _readers_refuse(job, out, "manifest/w00000.jsonl line")
    other = copy_output(reference, tmp_path / "other")
    write_manifest(other, [manifest_lines(other)[2]], tag="w00001")  # and in another worker's manifest
    result = cli("export", str(other), "--to", str(tmp_path / "e.jsonl"))
    assert result.exit_code == 2 and "manifest/w00001.jsonl line 1" in result.output
    assert "committed twice" in result.output or "duplicated record" in result.output


def test_a_shard_with_fewer_rows_than_its_old_format_record_is_never_exported(ref, tmp_path):
    job, reference, _ = ref
    out = copy_output(reference, tmp_path / "out")
    lines = manifest_lines(out)
    legacy = [json.dumps({k: v for k, v in json.loads(ln).items() if k not in ("check", "files")},
                         separators=(",", ":")).encode() for ln in lines]  # written before checksums
    write_manifest(out, legacy)
    shard = sorted((out / "data").glob("*.parquet"))[0]
    table = pq.read_table(shard)
    pq.write_table(table.slice(0, table.num_rows - 1), shard)
    result = cli("export", str(out), "--to", str(tmp_path / "e.jsonl"))
    assert result.exit_code == 2 and f"data/{shard.name}" in result.output and "rows" in result.output


def test_old_manifests_without_checksums_still_resume_and_verify_says_they_are_unchecked(ref, tmp_path):
    job, reference, rows = ref
    out = copy_output(reference, tmp_path / "out")
    lines = manifest_lines(out)
    legacy = [json.dumps({k: v for k, v in json.loads(ln).items() if k not in ("check", "files")},
                         separators=(",", ":")).encode() for ln in lines[:-1]]
    write_manifest(out, legacy)
    (out / "data" / json.loads(lines[-1])["data"].split("/")[1]).unlink()  # as if the last commit never happened
    done = cli("run", str(job), "-o", str(out))
    assert done.exit_code == 0, done.output
    assert content(out) == rows
    verified = cli("verify", str(out))
    assert verified.exit_code == 0, verified.output
    assert f"{len(legacy)} records were written before manifests carried checksums" in verified.output


def test_orphan_clean_up_deletes_the_crash_leftover_and_tmp_only_never_a_foreign_file(ref, tmp_path):
    job, reference, rows = ref
    out = copy_output(reference, tmp_path / "out")
    lines = manifest_lines(out)
    last = json.loads(lines[-1])
    write_manifest(out, lines[:-1])  # a crash between the last shard's rename and its record's append
    (out / "data" / ".part-w00000-000099.parquet.tmp").write_bytes(b"half a shard")
    (out / "data" / "notes.txt").write_text("the user's")
    done = cli("run", str(job), "-o", str(out))
    assert done.exit_code == 0, done.output
    assert content(out) == rows
    assert (out / "data" / "notes.txt").read_text() == "the user's"
    assert not (out / "data" / ".part-w00000-000099.parquet.tmp").exists()
    assert (out / last["data"]).exists()  # regenerated under the same commit number
    # a committed shard whose record was lost is not a leftover: the run refuses and deletes nothing
    lines = manifest_lines(out)
    write_manifest(out, [lines[0], *lines[2:]])
    kept = json.loads(lines[1])["data"]
    result = cli("run", str(job), "-o", str(out))
    assert result.exit_code == 2 and kept in result.output and "record was lost" in result.output
    assert (out / kept).exists()


def test_export_writes_nan_and_infinity_as_null_valid_json(tmp_path, tiny_model_dir):
    values = [1.5, math.nan, math.inf, -math.inf]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(4)], "topic": ["a", "b", "c", "d"],
                             "level": [1, 2, 3, 4], "score": values}), tmp_path / "rows.parquet")
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.parquet", "key_column": "id"},
                    output={"report": False})
    assert cli("run", str(job), "-o", str(tmp_path / "out")).exit_code == 0
    result = cli("export", str(tmp_path / "out"), "--to", str(tmp_path / "e.jsonl"))
    assert result.exit_code == 0, result.output

    def strict(token):
        raise ValueError(f"not JSON: {token}")

    rows = [json.loads(line, parse_constant=strict) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [r["score"] for r in sorted(rows, key=lambda r: r["id"])] == [1.5, None, None, None]


def test_a_corrupt_fingerprint_is_exit_2_naming_it_never_run_again(ref, tmp_path):
    job, reference, _ = ref
    out = copy_output(reference, tmp_path / "out")
    (out / "fingerprint.json").write_bytes(b"\x00" * 40)
    for args in (("run", str(job), "-o", str(out)), ("report", str(out))):
        result = cli(*args)
        assert result.exit_code == 2, result.output
        assert "fingerprint.json is damaged" in result.output and "run the same command again" not in result.output


def test_a_corrupt_run_report_is_named_by_report_and_status(ref, tmp_path):
    job, reference, _ = ref
    out = copy_output(reference, tmp_path / "out")
    (out / "reports" / "w00000.json").write_bytes(b'{"status": "compl\xff')
    result = cli("report", str(out))
    assert result.exit_code == 2 and "reports/w00000.json is damaged" in result.output, result.output
    status = cli("status", str(out))
    assert status.exit_code == 0 and "reports/w00000.json is damaged" in status.output


def test_bad_throughput_log_lines_are_skipped_and_named_by_report(ref, tmp_path):
    job, reference, _ = ref
    out = copy_output(reference, tmp_path / "out")
    log = out / "logs" / "throughput-w00000.jsonl"
    log.write_bytes(b"\x00\x00\x00\n[1, 2]\n\xff\xfe\n" + log.read_bytes())
    result = cli("report", str(out))
    assert result.exit_code == 0, result.output
    assert "logs/throughput-w00000.jsonl: 3 damaged lines" in result.output
    assert cli("status", str(out)).exit_code == 0

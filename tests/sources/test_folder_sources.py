"""A folder as source.path reads its files of one kind (.jsonl, .ndjson or .jsonl.gz through the JSONL reader;
.parquet), leaves .json sidecars alone, refuses a folder of several kinds, and never reads a batchgen output inside
it: a job whose output folder lies in its source folder reads its input, not its own shards, on every run."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.config import SourceSpec
from batchgen.errors import JobError
from batchgen.sources import open_source
from jobutil import invoke_run, read_rows, seed_rows, write_job, write_jsonl


def _lines(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_folder_of_one_json_lines_kind_is_read_through_the_json_lines_reader_and_json_sidecars_are_not(tmp_path):
    rows = seed_rows(6)
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jsonl.gz").write_bytes(gzip.compress(_lines(rows[0:2]).encode()))
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(_lines(rows[2:4]).encode()))
    (folder / "sub" / "c.jsonl.gz").write_bytes(gzip.compress(_lines(rows[4:6]).encode()))
    (folder / "stats.json").write_text(json.dumps({"id": "not a row", "topic": "x"}))  # a sidecar, not rows
    (folder / "notes.txt").write_text("not rows")
    source = open_source(SourceSpec(path=str(folder)))
    assert type(source).__name__ == "JsonlSource"  # not `datasets` (a malformed line is then a reject, not exit 1)
    assert [r.columns["id"] for r in source] == [r["id"] for r in rows]


def test_a_parquet_folder_with_json_sidecars_reads_its_parquet_files(tmp_path):
    folder = tmp_path / "in"
    (folder / "_delta_log").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(seed_rows(3)), folder / "a.parquet")
    (folder / "_delta_log" / "00000.json").write_text("{}")
    (folder / "dataset_infos.json").write_text("{}")
    assert open_source(SourceSpec(path=str(folder))).num_rows == 3


@pytest.mark.parametrize("other", ["b.jsonl.gz", "b.parquet", "b.ndjson"])
def test_a_folder_of_data_files_of_several_kinds_is_refused_naming_each(tmp_path, other):
    """.jsonl beside .jsonl.gz is often one data twice: reading both repeats rows, reading one drops the other."""
    folder = tmp_path / "in"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", seed_rows(2))
    if other.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(seed_rows(2)), folder / other)
    else:
        (folder / other).write_bytes(gzip.compress(_lines(seed_rows(2)).encode()) if other.endswith(".gz")
                                     else _lines(seed_rows(2)).encode())
    suffix = other.removeprefix("b")
    with pytest.raises(JobError, match=f"holding data files of several kinds: .*{suffix} .*{other}"):
        open_source(SourceSpec(path=str(folder)))
    if other.endswith(".parquet"):  # a type set explicitly reads its own kind alone
        assert type(open_source(SourceSpec(path=str(folder), type="parquet"))).__name__ == "ParquetSource"
    else:  # but not one data twice under two names of its kind
        with pytest.raises(JobError, match="several kinds"):
            open_source(SourceSpec(path=str(folder), type="jsonl"))


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_an_output_inside_the_source_folder_is_never_read_as_input(tmp_path, tiny_model_dir, kind):
    def write_rows(n):
        if kind == "jsonl":
            write_jsonl(tmp_path / "rows.jsonl", seed_rows(n))
        else:
            pq.write_table(pa.Table.from_pylist(seed_rows(n)), tmp_path / "rows.parquet")

    write_rows(4)
    job = write_job(tmp_path, tiny_model_dir, {"path": ".", "key_column": "id"})  # the job's folder, out/ in it
    first = invoke_run(job)
    assert first.exit_code == 0, first.output
    write_rows(8)  # four rows more: the source is the input file, not out/data's shards
    again = invoke_run(job)
    assert again.exit_code == 0 and "4 already done" in again.output, again.output
    assert sorted(r["id"] for r in read_rows(tmp_path / "out")) == [r["id"] for r in seed_rows(8)]


@pytest.mark.parametrize("name,pattern", [("rows.jsonl.zst", "rows.jsonl.zst"), ("rows.gz", "*.gz"),
                                          ("rows.csv", "rows.csv")])
def test_a_file_no_reader_takes_by_its_name_is_refused_saying_what_is_read(tmp_path, name, pattern):
    (tmp_path / name).write_bytes(b"not read")
    with pytest.raises(JobError, match="a file batchgen does not read by its name: it reads .parquet, .jsonl"):
        open_source(SourceSpec(path=str(tmp_path / pattern)))

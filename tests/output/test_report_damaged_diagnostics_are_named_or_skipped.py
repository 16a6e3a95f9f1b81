"""Damaged diagnostics files under an output (a worker's run report, a throughput-log record) never turn into
"the run failed ... run the same command again" (exit 1, failing the same way every time):

- a reports/wNNNNN.json that lacks a key the card shows, or holds null or text where the card needs a number:
  `batchgen report` stops with exit 2 naming the file and the key (the card would otherwise misstate throughput);
- a throughput-log record with a null or non-numeric field the plot reads: skipped like any damaged log line, the
  note counting it, the plot and card written;
- at the end of `batchgen run` the rows are committed: either kind of damage leaves the run's exit 0, the first
  one said on stderr with the file and key."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows, seed_rows, write_job, write_jsonl

runner = CliRunner()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir):
    """A finished job's folder (job file, source, output), run once for the module."""
    tmp = tmp_path_factory.mktemp("damaged_diagnostics")
    write_jsonl(tmp / "rows.jsonl", seed_rows(3))
    job = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"max_new_tokens": 4}, output={"report": False})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    return tmp


@pytest.fixture
def out(finished, tmp_path):
    """A copy of the finished job's folder in tmp_path (each test damages its own), and its output."""
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    return tmp_path / "out"


def _edit_report(out, name="w00000.json", **changes):
    path = out / "reports" / name
    report = json.loads((out / "reports" / "w00000.json").read_text())
    for key, value in changes.items():
        if value is KeyError:
            del report[key]
        else:
            report[key] = value
    path.write_text(json.dumps(report))
    return path


@pytest.mark.parametrize("key,value,says", [
    ("generated_tokens", KeyError, "no 'generated_tokens' key"),
    ("wall_s", KeyError, "no 'wall_s' key"),
    ("wall_s", None, "'wall_s' is null"),
    ("generated_tokens", "9", "'generated_tokens' is \"9\""),
    ("status", None, "'status' is null"),
])
def test_a_damaged_run_report_stops_report_with_exit_2_naming_the_file_and_key(out, key, value, says):
    _edit_report(out, **{key: value})
    result = runner.invoke(app, ["report", str(out)])
    assert result.exit_code == 2, result.output
    assert "reports/w00000.json is damaged" in result.output and says in result.output, result.output
    assert "run the same command again" not in result.output and "delete it" in result.output


def test_once_the_damaged_report_is_deleted_the_card_is_written(out):
    path = _edit_report(out, generated_tokens=KeyError)
    assert runner.invoke(app, ["report", str(out)]).exit_code == 2
    path.unlink()
    result = runner.invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "README.md").is_file()


DAMAGED_RECORDS = [  # each a JSON object whose time and elapsed_s are fine
    {"kv_cache_usage": None}, {"num_running": "many"}, {"num_generated_tokens": None}, {"num_waiting": True},
]


def test_throughput_log_records_with_null_or_non_numeric_fields_are_skipped_and_counted(out):
    log = out / "logs" / "throughput-w00000.jsonl"
    first = json.loads(log.read_text().splitlines()[0])
    with log.open("a") as f:
        for i, bad in enumerate(DAMAGED_RECORDS):
            f.write(json.dumps({**first, "time": first["time"] + 1 + i, "elapsed_s": first["elapsed_s"] + 1 + i,
                                **bad}) + "\n")
        f.write("not json\n")
    result = runner.invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
    assert f"logs/throughput-w00000.jsonl: {len(DAMAGED_RECORDS) + 1} damaged lines" in result.output
    assert (out / "reports" / "throughput.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (out / "README.md").is_file() and (out / "reports" / "index.html").is_file()


def test_damaged_diagnostics_never_fail_a_run_whose_rows_are_committed(out, tmp_path):
    rows_before = read_rows(out)
    _edit_report(out, name="w00001.json", generated_tokens=KeyError)  # another worker's report, damaged
    with (out / "logs" / "throughput-w00000.jsonl").open("a") as f:
        f.write(json.dumps({"time": 1.0e9, "elapsed_s": 1.0, "kv_cache_usage": None}) + "\n")
    result = runner.invoke(app, ["run", str(tmp_path / "job.yaml"), "--no-progress", "--set", "output.report=true"])
    assert result.exit_code == 0, result.output
    assert "reports/w00001.json is damaged (no 'generated_tokens' key" in result.output, result.output
    assert "the output is complete" in result.output
    assert read_rows(out) == rows_before
    (out / "reports" / "w00001.json").unlink()  # the user deletes it: the next run writes the whole report
    result = runner.invoke(app, ["run", str(tmp_path / "job.yaml"), "--no-progress", "--set", "output.report=true"])
    assert result.exit_code == 0, result.output
    assert "could not be written" not in result.output and "1 damaged lines" in result.output
    assert (out / "README.md").is_file() and (out / "reports" / "throughput.png").is_file()

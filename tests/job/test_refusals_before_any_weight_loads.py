"""A run's start: a device the machine lacks is refused up front by validate and run; a refused resume and a job
with every row done never load the model's weights."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows, seed_rows, write_job, write_jsonl

runner = CliRunner()


@pytest.fixture
def job(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(6))
    return write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["run", "validate"])
def test_model_device_cuda_without_cuda_exits_2_naming_model_device(job, command):
    result = runner.invoke(app, [command, str(job), "--set", "model.device=cuda"])
    assert result.exit_code == 2, result.output
    assert "model.device is 'cuda' but this machine has no CUDA GPU" in result.output
    assert "Traceback" not in result.output and "resume" not in result.output


def test_an_unknown_device_name_exits_2_naming_model_device(job):
    result = runner.invoke(app, ["validate", str(job), "--set", "model.device=tpu"])
    assert result.exit_code == 2 and "model.device 'tpu'" in result.output


def test_a_refused_resume_and_a_finished_job_load_no_weights(job, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert runner.invoke(app, ["run", str(job), "-o", str(out), "--no-progress"]).exit_code == 0
    assert len(read_rows(out)) == 6

    def no_weights(*args, **kwargs):
        raise AssertionError("the model's weights were loaded")

    monkeypatch.setattr("batchgen.job.loop.load_model", no_weights)
    done = runner.invoke(app, ["run", str(job), "-o", str(out), "--no-progress"])
    assert done.exit_code == 0, done.output
    assert "6 already done" in done.output
    refused = runner.invoke(app, ["run", str(job), "-o", str(out), "--no-progress",
                                  "--set", "sampling.temperature=0.5"])
    assert refused.exit_code == 2 and "sampling.temperature" in refused.output, refused.output

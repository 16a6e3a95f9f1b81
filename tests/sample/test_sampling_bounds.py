"""Sampling values the float32 sampler cannot honour are refused naming them, not turned into wrong tokens: a
temperature other than 0 outside [MIN_TEMPERATURE, MAX_TEMPERATURE] (1e-40 drew token 0 on ties; inf gave NaN
logits that broke response_format, min_new_tokens and top_k), a repetition penalty beyond float32's reach, and
`true` where a count is asked (n: true meant 1). In the job file the error names the key; in a row's own
sampling column it is that row's bad_sampling reject."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.sampling_params import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams
from jobutil import read_rows, seed_rows, write_job, write_jsonl


@pytest.mark.parametrize("values", [{"temperature": 1e-40}, {"temperature": MIN_TEMPERATURE / 2},
                                    {"temperature": float("inf")}, {"temperature": MAX_TEMPERATURE * 2},
                                    {"repetition_penalty": 1e39}, {"repetition_penalty": 1e-39},
                                    {"n": True}, {"max_new_tokens": True}, {"seed": False}, {"top_k": True},
                                    {"min_new_tokens": True}, {"thinking_budget": True}])
def test_values_the_sampler_cannot_honour_are_refused_naming_the_field(values):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**values)
    assert next(iter(values)) in str(e.value)


@pytest.mark.parametrize("values", [{"temperature": 0}, {"temperature": MIN_TEMPERATURE},
                                    {"temperature": MAX_TEMPERATURE}, {"temperature": 0.7},
                                    {"repetition_penalty": 1.3}, {"n": 3, "seed": 0, "top_k": 1}])
def test_values_within_the_bounds_pass(values):
    SamplingParams(**values)


def test_a_row_asking_an_out_of_range_temperature_is_its_own_reject_and_the_job_ends(tmp_path, tiny_model_dir):
    rows = seed_rows(4)
    rows[1]["sampling"] = json.dumps({"temperature": 1e-40})
    rows[2]["sampling"] = json.dumps({"n": True})
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id",
                                               "sampling_column": "sampling"}, sampling={"max_new_tokens": 4})
    result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert sorted(r["id"] for r in read_rows(tmp_path / "out")) == ["row-0000", "row-0003"]
    rejects = read_rows(tmp_path / "out", "rejects")
    assert sorted((r["id"], r["error_class"]) for r in rejects) == [("row-0001", "bad_sampling"),
                                                                   ("row-0002", "bad_sampling")]
    assert "temperature" in rejects[0]["message"] + rejects[1]["message"]
    refused = CliRunner().invoke(app, ["run", str(job), "--no-progress", "--fresh", "--set",
                                       "sampling.temperature=1e-40"])
    assert refused.exit_code == 2 and "sampling.temperature" in refused.output

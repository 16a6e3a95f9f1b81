"""`batchgen.ray.build_processor`: a Ray Data stage over a Dataset gives the rows `batchgen run` writes (greedy,
n=2, two actors); a row whose prompt cannot render comes back as one error row beside complete ones; the job may
be a YAML path, a JobSpec or a dict (without source: rows are keyed by a hash of their values); list, struct and
log-prob columns keep their types; a Dataset that does not fit the job fails with batchgen's message; without Ray
installed, build_processor says how to install it. One local Ray instance for the module (starting Ray costs
~10 s on a 2-core machine)."""

from __future__ import annotations

import sys
import warnings

import pytest
import yaml

from batchgen.errors import JobError
from batchgen.job.job_file import load_spec
from batchgen.ray import build_processor
from batchgen.ray.processor import row_key
from batchgen.seeding import derive_seed
from jobutil import read_rows, run_cli, seed_rows, write_job, write_jsonl

ray = pytest.importorskip("ray")

NUM_ROWS = 24
SEED = 3  # the job's sampling.seed (jobutil.write_job)
# what may differ between two runs of the same rows: prefix-cache hits depend on which rows shared an engine
VARIES = ("num_cached_tokens",)


@pytest.fixture(scope="module")
def ray_here():
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    """The rows, the job file and what `batchgen run` writes for them (keyed by id, two greedy samples a row)."""
    tmp = tmp_path_factory.mktemp("processor")
    rows = seed_rows(NUM_ROWS)
    write_jsonl(tmp / "rows.jsonl", rows)
    job = write_job(tmp, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"n": 2}, output={"report": False})
    done = run_cli("run", str(job), "-o", str(tmp / "cli"))
    assert done.returncode == 0, done.stderr
    reference = {(r["id"], r["sample_idx"]): r for r in read_rows(tmp / "cli")}
    assert len(reference) == 2 * NUM_ROWS
    return tmp, job, rows, reference


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in VARIES}


def test_concurrency_two_gives_the_rows_batchgen_run_writes(setup, ray_here):
    tmp, job, rows, reference = setup
    processor = build_processor(str(job), concurrency=2, batch_size=5)
    got = processor(ray.data.from_items(rows)).take_all()
    assert len(got) == len(reference)
    by_key = {(r["id"], r["sample_idx"]): r for r in got}
    assert set(by_key) == set(reference), "a sample is missing or came back twice"
    for key, ref in reference.items():
        row = by_key[key]
        assert row.pop("error_class") is None and row.pop("error") is None
        assert _comparable(row) == _comparable(ref), key
    assert {r["finish_reason"] for r in got} <= {"length", "stop"}


def test_a_row_whose_prompt_does_not_render_comes_back_as_an_error_row(setup, ray_here):
    tmp, job, rows, reference = setup
    bad = {**rows[1], "topic": None}  # the template's {{ topic }}: a null column fails the render (null_value)
    some = [rows[0], bad, rows[2], rows[3]]
    got = build_processor(load_spec(job))(ray.data.from_items(some)).take_all()
    errors = [r for r in got if r["finish_reason"] == "error"]
    assert len(errors) == 1
    error = errors[0]
    assert error["id"] == bad["id"] and error["error_class"] == "null_value" and "topic" in error["error"]
    assert error["level"] == bad["level"] and error["topic"] is None  # its kept columns come along
    assert error["sample_idx"] is None and error["completion"] is None and error["seed"] is None
    good = sorted((r for r in got if r is not error), key=lambda r: (r["id"], r["sample_idx"]))
    assert [(r["id"], r["sample_idx"]) for r in good] == [(rows[i]["id"], s) for i in (0, 2, 3) for s in (0, 1)]
    for r in good:
        assert r["error_class"] is None and r["error"] is None
        assert _comparable({k: v for k, v in r.items() if k not in ("error_class", "error")}) == \
            _comparable(reference[(r["id"], r["sample_idx"])])


def test_a_job_dict_without_source_keys_rows_by_their_hash_and_keeps_nested_columns(setup, ray_here):
    tmp, job, rows, reference = setup
    data = yaml.safe_load(job.read_text())
    del data["source"]  # no key_column: rows are keyed by row_key, and `id` is a kept column like any other
    data["sampling"]["logprobs"] = 2
    data["output"]["keep_token_ids"] = True
    some = [{**r, "tags": [r["topic"], "x"], "meta": {"level": r["level"]}} for r in rows[4:8]]
    got = build_processor(data)(ray.data.from_items(some)).take_all()
    assert len(got) == 2 * len(some)
    keys = {r["id"]: row_key(r) for r in some}
    for r in got:
        assert r["row_key"] == keys[r["id"]]
        assert r["seed"] == derive_seed(SEED, keys[r["id"]], r["sample_idx"])
        ref = reference[(r["id"], r["sample_idx"])]
        assert (r["completion"], r["finish_reason"], r["num_prompt_tokens"], r["num_completion_tokens"]) == \
            (ref["completion"], ref["finish_reason"], ref["num_prompt_tokens"], ref["num_completion_tokens"])
        source = next(s for s in some if s["id"] == r["id"])
        assert list(r["tags"]) == source["tags"] and r["meta"] == source["meta"]
        ids = list(r["completion_token_ids"])
        assert len(ids) == len(r["completion_logprobs"]) == len(r["completion_top_logprobs"]) == \
            r["num_completion_tokens"]
        # greedy: each sampled token is its position's most likely one, with that log-prob
        assert [top[0]["token_id"] for top in r["completion_top_logprobs"]] == ids
        assert [top[0]["logprob"] for top in r["completion_top_logprobs"]] == list(r["completion_logprobs"])
    assert "row_idx" not in got[0]


def test_a_template_naming_a_column_the_dataset_lacks_fails_the_dataset_with_batchgens_message(setup, ray_here):
    tmp, job, rows, _ = setup
    without_level = [{k: v for k, v in r.items() if k != "level"} for r in rows[:2]]
    # Ray Data wraps an actor's exception in its UserCodeException; JobError's message is in its text
    with pytest.raises(ray.exceptions.UserCodeException, match="JobError: prompt.template uses level"):
        build_processor(str(job))(ray.data.from_items(without_level)).take_all()


def test_a_schema_keyword_xgrammar_does_not_enforce_is_warned_of_when_the_processor_is_built(setup):
    tmp, job, _, _ = setup
    data = yaml.safe_load(job.read_text())
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    data["sampling"]["response_format"] = {"type": "json_schema", "json_schema": schema}
    with pytest.warns(UserWarning, match="does not enforce: 'uniqueItems' at /properties/tags"):
        build_processor(data)
    del schema["properties"]["tags"]["uniqueItems"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an enforced schema: no warning
        build_processor(data)


def test_without_ray_build_processor_says_how_to_install_it(setup, monkeypatch):
    tmp, job, _, _ = setup
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(JobError, match="pip install"):
        build_processor(str(job))

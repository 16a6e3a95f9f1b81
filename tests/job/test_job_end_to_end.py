"""`batchgen run` end to end on Parquet, JSONL and `datasets` sources, plus validate and status."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from jobutil import read_rows, seed_rows, write_job, write_jsonl

runner = CliRunner()


def _make_source(tmp_path, kind: str, rows: list[dict]) -> dict:
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows[:7]), tmp_path / "a.parquet")
        pq.write_table(pa.Table.from_pylist(rows[7:]), tmp_path / "b.parquet")
        return {"path": "*.parquet", "key_column": "id"}
    if kind == "jsonl":
        write_jsonl(tmp_path / "rows.jsonl", rows)
        return {"path": "rows.jsonl", "key_column": "id"}
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    return {"path": "ds", "key_column": "id"}


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "hf"])
def test_run_writes_every_row_once_with_the_documented_columns(tmp_path, tiny_model_dir, kind):
    rows = seed_rows(13)
    job = write_job(tmp_path, tiny_model_dir, _make_source(tmp_path, kind, rows),
                    sampling={"n": 2, "temperature": 0.8})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "13 rows committed" in result.output
    out = read_rows(tmp_path / "out")
    assert sorted((r["id"], r["sample_idx"]) for r in out) == sorted((r["id"], s) for r in rows for s in (0, 1))
    first = out[0]
    for col in ("id", "sample_idx", "topic", "level", "completion", "finish_reason", "num_prompt_tokens",
                "num_completion_tokens", "num_cached_tokens", "seed"):
        assert col in first
    assert all(r["finish_reason"] in ("stop", "length", "stop_string") for r in out)
    assert all(0 < r["num_completion_tokens"] <= 12 for r in out)
    # loadable as one dataset, shards of at most 5 rows x 2 samples
    files = sorted(str(p) for p in (tmp_path / "out" / "data").glob("*.parquet"))
    assert len(files) >= 2
    ds = datasets.load_dataset("parquet", data_files=files, split="train")
    assert ds.num_rows == 26
    report = json.loads(next((tmp_path / "out" / "reports").glob("*.json")).read_text())
    assert report["rows_committed"] == 13 and report["generated_tokens"] == sum(r["num_completion_tokens"] for r in out)
    log = (tmp_path / "out" / "logs" / "throughput-w00000.jsonl").read_text().splitlines()
    last = json.loads(log[-1])
    assert last["rows_done"] == 13
    # where the loop's time went: engine steps, admitting rows, commits (3 shards here), garbage collection
    assert last["step_s"] > 0 and last["admit_s"] > 0 and last["commit_s"] > 0 and last["gc_s"] >= 0
    assert set(report["loop_s"]) == {"step", "admit", "commit", "gc", "triton_compile"}
    # the parts are the loop's own time: the engine's set-up (built on the first admitted row) is in setup_s only
    loop = report["loop_s"]
    assert loop["step"] + loop["admit"] + loop["commit"] <= report["wall_s"] + 0.01
    assert last["compile_s"] >= 0 and isinstance(report["triton_kernels_compiled"], dict)
    assert report["engine_setup_triton_compile_s"] >= 0
    builds = report["triton_builds"]  # empty on CPU: the interpreter builds nothing
    assert builds == {"setup": [], "loop": [], "not_listed": 0}


def test_gc_timer_adds_collector_time_while_installed_and_leaves_no_hook_behind():
    import gc

    from batchgen.job.metrics import GcTimer, Totals

    totals = Totals()
    timer = GcTimer(totals)
    garbage = [[] for _ in range(20000)]
    for a, b in zip(garbage, garbage[1:]):
        a.append(b)
        b.append(a)  # reference cycles: real work for the collector
    del garbage, a, b
    gc.collect()
    timer.remove()
    assert totals.gc_s > 0 and timer not in gc.callbacks
    before = totals.gc_s
    gc.collect()
    assert totals.gc_s == before


def test_a_run_freezes_what_its_set_up_built_so_no_full_collection_walks_the_model_mid_run(tmp_path,
                                                                                          tiny_model_dir):
    """After the engine's set-up the job runner collects once and freezes every object alive (the model, the
    tokenizer, torch's modules): later full GC passes skip them. That set-up pass is not in the loop's GC time."""
    import gc

    rows = seed_rows(6)
    job = write_job(tmp_path, tiny_model_dir, {"path": str(write_jsonl(tmp_path / "in.jsonl", rows)),
                                               "key_column": "id"},
                    prompt={"template": "Tell me about {{ topic }}."},
                    sampling={"max_new_tokens": 4, "temperature": 0.0}, output={"dir": str(tmp_path / "out")})
    gc.unfreeze()
    try:
        result = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
        assert result.exit_code == 0, result.output
        assert gc.get_freeze_count() > 1000  # at least the tiny model's modules and the tokenizer
    finally:
        gc.unfreeze()  # the rest of this test process collects as before
    report = json.loads(next((tmp_path / "out" / "reports").glob("w*.json")).read_text())
    assert report["loop_s"]["gc"] < report["setup_s"]


def test_compile_timer_times_each_triton_build_chains_the_previous_hooks_and_puts_them_back():
    """Triton calls knobs.runtime.jit_cache_hook before building a kernel specialisation and
    jit_post_compile_hook after (keyword arguments key= and fn=, a JitFunctionInfo); here the hooks are called as
    Triton calls them, since CPU tests build no kernels (the interpreter has no JIT)."""
    import time
    from collections import namedtuple

    from triton import knobs

    from batchgen.job.metrics import CompileTimer, Totals

    Info = namedtuple("JitFunctionInfo", "module name jit_function")
    calls = []
    prev = (lambda **kw: calls.append(("before", kw["key"])), lambda **kw: calls.append(("after", kw["key"])))
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = prev
    try:
        totals = Totals()
        timer = CompileTimer(totals)
        for name, key in (("_decode_kernel", ("i32", 16)), ("_decode_kernel", ("i32", 1)), ("_sample", ("f32",))):
            fn = Info("batchgen.kernels.x", name, None)
            assert knobs.runtime.jit_cache_hook(key=key, fn=fn, repr="", compile={}, is_manual_warmup=False,
                                                already_compiled=False) is None  # None: build it
            time.sleep(0.01)
            knobs.runtime.jit_post_compile_hook(key=key, fn=fn, repr="", compile={}, is_manual_warmup=False,
                                                already_compiled=False)
        assert totals.compiled_kernels == {"_decode_kernel": 2, "_sample": 1} and totals.compile_s >= 0.03
        assert [b["kernel"] for b in totals.builds] == ["_decode_kernel", "_decode_kernel", "_sample"]
        assert all(b["s"] >= 0.009 for b in totals.builds)  # each build's own time
        assert calls == [("before", ("i32", 16)), ("after", ("i32", 16)), ("before", ("i32", 1)),
                         ("after", ("i32", 1)), ("before", ("f32",)), ("after", ("f32",))]
        timer.remove()
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == prev
        # removed out of order: the first timer stops counting at once and only forwards to the hooks before it
        first, second = CompileTimer(Totals()), CompileTimer(Totals())
        first.remove()
        fn = Info("m", "_k", None)
        knobs.runtime.jit_cache_hook(key=1, fn=fn, repr="", compile={}, is_manual_warmup=False, already_compiled=False)
        knobs.runtime.jit_post_compile_hook(key=1, fn=fn, repr="", compile={}, is_manual_warmup=False,
                                            already_compiled=False)
        assert first.totals.compiled_kernels == {} and second.totals.compiled_kernels == {"_k": 1}
        assert calls[-2:] == [("before", 1), ("after", 1)]  # still forwarded down the chain
        second.remove()
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == prev
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def test_compile_timer_records_each_builds_specialisation_from_tritons_own_hook_call():
    """Triton 3.6's JITFunction._call_hook builds the hooks' keywords (the `compile` dict: signature, constants,
    configs) itself; the spec recorded names each argument's type, its divisibility by 16 and the constexprs."""
    from types import SimpleNamespace

    import triton
    import triton.language as tl
    from triton import knobs

    from batchgen.job.metrics import CompileTimer, Totals

    @triton.jit
    def _k(x_ptr, n, stride, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK) * stride, tl.zeros([BLOCK], tl.float32), mask=tl.arange(0, BLOCK) < n)

    options = SimpleNamespace(num_warps=4, num_ctas=1, num_stages=3, enable_fp_fusion=True,
                              launch_cooperative_grid=False, extern_libs=None)
    signature = {"x_ptr": "*fp32", "n": "i32", "stride": "constexpr", "BLOCK": "constexpr"}
    constants, attrs = {(2,): 1, (3,): 64}, {(0,): [["tt.divisibility", 16]]}
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        totals = Totals()
        timer = CompileTimer(totals)
        for hook in (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook):
            _k._call_hook(hook, "key-1", signature, 0, constants, options, [attrs], False)
        timer.remove()
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved
    (build,) = totals.builds
    assert build["kernel"].endswith("._k")  # Triton's qualified name of the test's local kernel
    assert build["spec"] == "warps 4, stages 3: x_ptr: *fp32D, n: i32, stride=1, BLOCK=64"


def test_second_run_skips_everything_and_status_reports_completion(tmp_path, tiny_model_dir):
    job = write_job(tmp_path, tiny_model_dir, _make_source(tmp_path, "parquet", seed_rows(9)))
    assert runner.invoke(app, ["run", str(job), "--no-progress"]).exit_code == 0
    before = read_rows(tmp_path / "out")
    again = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert again.exit_code == 0 and "0 rows committed" in again.output and "9 already done" in again.output
    assert read_rows(tmp_path / "out") == before
    status = runner.invoke(app, ["status", str(tmp_path / "out")])
    assert status.exit_code == 0 and "9 rows committed of 9 (100.0%)" in status.output and "complete" in status.output


def test_rows_without_key_column_are_keyed_by_position_and_prompt_can_be_kept(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "rows.jsonl", [{"text": f"Say hello number {i}."} for i in range(6)])
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl"},
                    prompt={"template": None, "column": "text", "chat": False},
                    output={"keep_prompt": True, "keep_columns": "none"})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    out = sorted(read_rows(tmp_path / "out"), key=lambda r: r["row_idx"])
    assert [r["row_idx"] for r in out] == list(range(6))
    assert out[2]["prompt"] == "Say hello number 2." and "text" not in out[2]


def test_kept_token_ids_count_and_decode_to_the_completion(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    job = write_job(tmp_path, tiny_model_dir, _make_source(tmp_path, "parquet", seed_rows(8)),
                    output={"keep_token_ids": True})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = read_rows(tmp_path / "out")
    assert len(out) == 8
    for r in out:
        assert len(r["completion_token_ids"]) == r["num_completion_tokens"] > 0
        assert tok.decode(r["completion_token_ids"], skip_special_tokens=True) == r["completion"]


def test_validate_reports_source_prompts_and_token_lengths(tmp_path, tiny_model_dir):
    job = write_job(tmp_path, tiny_model_dir, _make_source(tmp_path, "jsonl", seed_rows(20)))
    result = runner.invoke(app, ["validate", str(job)])
    assert result.exit_code == 0, result.output
    assert "columns: id, topic, level" in result.output
    assert "Write about the sea at level 0." in result.output  # the first rendered prompt
    assert "prompt tokens over 20 rendered rows" in result.output
    assert not (tmp_path / "out").exists()  # validate writes nothing


def test_same_seed_gives_same_completions_across_runs_and_engine_knobs(tmp_path, tiny_model_dir):
    source = _make_source(tmp_path, "jsonl", seed_rows(10))
    job = write_job(tmp_path, tiny_model_dir, source, sampling={"temperature": 1.0, "n": 2})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0 and "decode forward fused;" in result.output  # the start-up line names the path
    assert runner.invoke(app, ["run", str(job), "--no-progress", "-o", str(tmp_path / "other"),
                               "--set", "engine.max_num_seqs=3"]).exit_code == 0
    # the fused decode forward off: transformers' modules decode, the start-up line says so, same output
    result = runner.invoke(app, ["run", str(job), "--no-progress", "-o", str(tmp_path / "unfused"),
                                 "--set", "engine.fused_decoder=false"])
    assert result.exit_code == 0 and "decode forward transformers (off)" in result.output
    key = lambda r: (r["id"], r["sample_idx"])  # noqa: E731
    a = sorted(read_rows(tmp_path / "out"), key=key)
    for other in ("other", "unfused"):
        b = sorted(read_rows(tmp_path / other), key=key)
        assert [r["completion"] for r in a] == [r["completion"] for r in b]
    assert len({r["seed"] for r in a}) == 20


def test_run_start_up_line_names_the_transformers_path_and_why_for_a_model_the_fused_forward_cannot_run(tmp_path):
    from conftest import make_model, make_tokenizer

    tok = make_tokenizer()
    model = make_model("phi3", vocab_size=len(tok), max_position_embeddings=256,  # Phi-4-mini's partial rotary
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    model.save_pretrained(tmp_path / "partial")
    tok.save_pretrained(tmp_path / "partial")
    job = write_job(tmp_path, str(tmp_path / "partial"), _make_source(tmp_path, "jsonl", seed_rows(2)),
                    sampling={"max_new_tokens": 4})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "decode forward transformers (partial rotary (8 of 16 head dims));" in result.output


def test_local_data_files_through_datasets(tmp_path, tiny_model_dir):
    folder = tmp_path / "files"
    folder.mkdir()
    rows = seed_rows(8)
    write_jsonl(folder / "part-0.jsonl", rows[:5])
    write_jsonl(folder / "part-1.jsonl", rows[5:])
    job = write_job(tmp_path, tiny_model_dir, {"path": "files", "type": "hf", "key_column": "id",
                                               "streaming": False})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert sorted(r["id"] for r in read_rows(tmp_path / "out")) == [r["id"] for r in rows]


def test_the_progress_bar_knows_a_jsonl_sources_total_and_a_resumed_run_counts_the_committed_rows(
        tmp_path, tiny_model_dir):
    rows = seed_rows(12)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"})
    result = runner.invoke(app, ["run", str(job)])  # with the progress bar
    assert result.exit_code == 0, result.output
    assert "12/12" in result.output
    write_jsonl(tmp_path / "rows.jsonl", rows + seed_rows(16)[12:])  # 4 more rows appended
    result = runner.invoke(app, ["run", str(job)])
    assert result.exit_code == 0, result.output
    assert "16/16" in result.output and "4 rows committed" in result.output  # the 12 done rows count as done


def test_sampling_column_overrides_the_jobs_sampling_per_row_and_bad_values_reject_only_their_row(
        tmp_path, tiny_model_dir):
    rows = seed_rows(6)
    overrides = [None, {"max_new_tokens": 3}, '{"n": 2, "temperature": 0.9, "seed": 11}', {"temperature": -1},
                 {"max_tokens_typo": 5}, "not json"]
    for r, o in zip(rows, overrides):
        r["params"] = o if isinstance(o, str) or o is None else json.dumps(o)
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id",
                                               "sampling_column": "params"}, output={"keep_columns": ["topic"]})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    out = read_rows(tmp_path / "out")
    by_key = {}
    for r in out:
        by_key.setdefault(r["id"], []).append(r)
    assert sorted(by_key) == ["row-0000", "row-0001", "row-0002"]
    assert by_key["row-0000"][0]["num_completion_tokens"] > 3  # the job's max_new_tokens: 12
    assert by_key["row-0001"][0]["num_completion_tokens"] <= 3
    assert len(by_key["row-0002"]) == 2  # n = 2 for that row only
    rejects = {r["id"]: r for r in read_rows(tmp_path / "out", "rejects")}
    assert {k: r["error_class"] for k, r in rejects.items()} == {
        "row-0003": "bad_sampling", "row-0004": "bad_sampling", "row-0005": "bad_sampling"}
    assert "temperature" in rejects["row-0003"]["message"]
    assert "max_tokens_typo" in rejects["row-0004"]["message"]
    assert "not JSON" in rejects["row-0005"]["message"]


def test_a_sampling_column_the_source_lacks_is_refused_naming_it(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(3))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "sampling_column": "params"})
    for command in ("run", "validate"):
        result = runner.invoke(app, [command, str(job)] + (["--no-progress"] if command == "run" else []))
        assert result.exit_code == 2 and "source.sampling_column 'params' is not a column" in result.output


def test_a_struct_sampling_column_from_parquet_overrides_only_the_fields_a_row_sets(tmp_path, tiny_model_dir):
    rows = seed_rows(3)
    rows[0]["params"] = {"max_new_tokens": 2, "n": None}  # pyarrow gives a struct's absent fields as null
    rows[1]["params"] = {"max_new_tokens": None, "n": 2}
    rows[2]["params"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.parquet", "key_column": "id",
                                               "sampling_column": "params"}, output={"keep_columns": ["topic"]})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 0, result.output
    out = read_rows(tmp_path / "out")
    assert not read_rows(tmp_path / "out", "rejects")
    counts = {k: [r["num_completion_tokens"] for r in out if r["id"] == k] for k in ("row-0000", "row-0001")}
    assert len(counts["row-0000"]) == 1 and counts["row-0000"][0] <= 2 and len(counts["row-0001"]) == 2


def test_turning_on_a_setting_an_older_output_predates_is_refused_on_resume(tmp_path, tiny_model_dir):
    rows = seed_rows(3)
    for r in rows:
        r["params"] = None
    write_jsonl(tmp_path / "rows.jsonl", rows)
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"})
    assert runner.invoke(app, ["run", str(job), "--no-progress"]).exit_code == 0
    fp = tmp_path / "out" / "fingerprint.json"
    stored = json.loads(fp.read_text())
    for k in ("sampling_column", "upstream"):  # as an output begun before these components existed
        stored["components"].pop(k)
    fp.write_text(json.dumps(stored))
    assert runner.invoke(app, ["run", str(job), "--no-progress"]).exit_code == 0  # unchanged: resumes
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id",
                                               "sampling_column": "params"})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 2 and "sampling_column: None -> 'params'" in result.output


def test_workers_writing_the_fingerprint_at_once_all_succeed_and_leave_one_file(tmp_path):
    """The workers of a job start together and each records the (same) fingerprint: every writer succeeds, one
    fingerprint.json remains, no temporary file is left behind (a shared temporary name made one worker's rename
    take the file another was writing: FileNotFoundError in CI)."""
    import threading

    from batchgen.output.fingerprint import FILE, check_or_write

    current = {"model": {"a": 1}, "sampling": {"temperature": 0.7}}
    for attempt in range(20):
        out = tmp_path / f"run{attempt}"
        out.mkdir()
        errors, barrier = [], threading.Barrier(8)

        def write():
            barrier.wait()
            try:
                check_or_write(out, current)
            except Exception as e:  # noqa: BLE001 - collected for the assertion below
                errors.append(e)

        threads = [threading.Thread(target=write) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and sorted(p.name for p in out.iterdir()) == [FILE]

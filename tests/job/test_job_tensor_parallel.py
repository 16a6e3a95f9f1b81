"""`batchgen run` with engine.tensor_parallel_size 2 on CPU (gloo): failed while building and killed mid-run,
then resumed, the job writes exactly the single-rank job's completions, each row once; bad tensor-parallel settings stop the job with one
message naming the key, before any weight is read (the model folders here hold no weights at all)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen.errors import JobError
from batchgen.job import ranks
from batchgen.job.job_file import load_spec
from conftest import make_tokenizer
from jobutil import read_rows, run_cli, seed_rows, write_job, write_jsonl

NUM_ROWS = 14


def _content(out: Path) -> list[dict]:
    rows = read_rows(out)
    keys = [(r["id"], r["sample_idx"]) for r in rows]
    assert len(keys) == len(set(keys)), "a row was written twice"
    return sorted(({k: v for k, v in r.items() if k != "num_cached_tokens"} for r in rows),
                  key=lambda r: (r["id"], r["sample_idx"]))


def test_tensor_parallel_job_killed_then_resumed_writes_the_single_rank_output_once(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(NUM_ROWS))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl", "key_column": "id"},
                    sampling={"temperature": 0.0, "max_new_tokens": 10},
                    engine={"max_num_seqs": 3, "async": True}, output={"rows_per_shard": 3})
    from batchgen.job.run import run_job

    run_job(load_spec(job, [], str(tmp_path / "single")), show_progress=False)  # the reference, in this process
    out = tmp_path / "tp2"
    # rank 0 fails building its engine while rank 1 builds its own (in the build's collectives): rank 0's error
    # stands, and the launcher ends rank 1 at once (a STOP then would meet rank 1's collective and hang)
    refused = run_cli("run", str(job), "-o", str(out), "--tensor-parallel", "2",
                      env={"BATCHGEN_FAULT": "engine_build:1"}, timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert "out of memory while setting up the engine" in refused.stderr
    assert read_rows(out) == []
    # rank 0 is killed (SIGKILL) right after its second commit; the launcher then ends rank 1
    killed = run_cli("run", str(job), "-o", str(out), "--tensor-parallel", "2", env={"BATCHGEN_FAULT": "commit_done:2"},
                     timeout=120)
    assert killed.returncode != 0
    assert 0 < len(read_rows(out)) < NUM_ROWS
    resumed = run_cli("run", str(job), "-o", str(out), "--tensor-parallel", "2", timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "tensor parallel 2 ranks" in resumed.stderr
    assert _content(out) == _content(tmp_path / "single")


def _config_only_model(root: Path, **config) -> str:
    """A model folder with a config and a tokenizer and no weights: whatever reads a weight fails."""
    root.mkdir()
    make_tokenizer().save_pretrained(root)
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_a_size_that_does_not_divide_the_heads_exits_2_naming_the_key_before_weights(tmp_path):
    model = _config_only_model(tmp_path / "llama", **LLAMA)
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(2))
    job = write_job(tmp_path, model, {"path": "rows.jsonl"})
    from typer.testing import CliRunner

    from batchgen.cli import app

    done = CliRunner().invoke(app, ["run", str(job), "--tensor-parallel", "3", "--no-progress"])
    assert done.exit_code == 2
    assert "engine.tensor_parallel_size 3" in done.output and "num_attention_heads (4)" in done.output


@pytest.mark.parametrize("config,message", [
    (dict(LLAMA, num_key_value_heads=1), "num_key_value_heads (1)"),
    (dict(LLAMA, intermediate_size=129), "intermediate_size (129)"),
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=512, n_embd=64, n_layer=2, n_head=4),
     "tensor parallelism needs a fused decoder; model type 'gpt2' runs transformers' modules"),
    (dict(LLAMA, quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]}),
     "num_attention_heads x head_dim (64) split 2 ways is 32 per rank, not whole FP8 scale blocks of 64 x 64"),
    (dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=4, moe_intermediate_size=33,
          shared_expert_intermediate_size=64, **{k: v for k, v in LLAMA.items()
                                                 if k not in ("model_type", "architectures")}),
     "moe_intermediate_size (33)"),  # the experts split along their intermediate dimension
])
def test_models_that_cannot_be_split_are_refused_from_their_config(tmp_path, config, message):
    model = _config_only_model(tmp_path / "m", **config)
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(2))
    spec = load_spec(write_job(tmp_path, model, {"path": "rows.jsonl"}), ["engine.tensor_parallel_size=2"])
    with pytest.raises(JobError, match="engine.tensor_parallel_size 2") as e:
        ranks.check_before_launch(spec)
    assert message in str(e.value)


def test_a_fused_decoder_not_listed_for_tensor_parallelism_is_refused_naming_the_list(monkeypatch):
    """A new family's fused decoder runs split only once it is listed (its layers sum over the ranks where they
    must): until then the config is refused, naming the families that are."""
    from transformers import LlamaConfig

    from batchgen.models import registry

    monkeypatch.setattr(registry, "TENSOR_PARALLEL_TYPES", ("qwen3",))
    reason = registry.tensor_parallel_reason(LlamaConfig(**{k: v for k, v in LLAMA.items() if k not in (
        "model_type", "architectures")}), 2)
    assert reason == "tensor parallelism is not built for model type 'llama''s fused decoder (built for: qwen3)"


def test_more_gpus_than_exist_or_than_divide_into_groups_are_refused(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(2))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl"}, model={"device": "auto"})
    spec = load_spec(job, ["engine.tensor_parallel_size=2"])
    with pytest.raises(JobError, match="--gpus 1 with engine.tensor_parallel_size 2: each worker takes 2 GPUs"):
        ranks.worker_gpus(spec, 0, [0], "1", num_available=1)
    with pytest.raises(JobError, match=r"tensor_parallel_size 2 x 2 worker\(s\) needs 4 GPUs; this machine has 2"):
        ranks.worker_gpus(spec, 2, None, None, num_available=2)
    assert ranks.worker_gpus(spec, 2, [0, 1, 2, 3], "4", num_available=4) == [0, 1, 2, 3]  # 2 workers x 2 GPUs
    assert ranks.worker_gpus(spec, 2, None, None, num_available=0) is None  # auto on a CPU machine: CPU ranks
    one_gpu = load_spec(job, ["engine.tensor_parallel_size=2", "model.device=cuda:1"])
    with pytest.raises(JobError, match="model.device 'cuda:1' names one GPU"):
        ranks.check_before_launch(one_gpu)


def test_tensor_parallelism_with_transformers_modules_is_refused_by_the_engine_config():
    from batchgen import EngineConfig

    for knobs in (dict(fused_decoder=False), dict(compile=True)):
        with pytest.raises(ValueError, match="engine.tensor_parallel_size 2 runs the fused decoders' sharded layers"):
            EngineConfig(tensor_parallel_size=2, **knobs)


def test_structured_output_with_tensor_parallelism_is_refused_naming_both_keys(tmp_path):
    """The grammar masks live on rank 0 only: a constrained job would sample differently on the other ranks."""
    model = _config_only_model(tmp_path / "llama", **LLAMA)
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(2))
    spec = load_spec(write_job(tmp_path, model, {"path": "rows.jsonl"}),
                     ["engine.tensor_parallel_size=2", "sampling.response_format={type: json_object}"])
    with pytest.raises(JobError, match="sampling.response_format .* engine.tensor_parallel_size 2"):
        ranks.check_before_launch(spec)


class _Rank:
    """A rank process as the launcher sees it: it ends with `code` once `ends_after` polls passed, or when
    killed; `patience` polls without either fails the test (the launcher waited for it)."""

    def __init__(self, code: int | None, ends_after: int = 0, patience: int = 50) -> None:
        self.code, self.ends_after, self.patience = code, ends_after, patience
        self.returncode, self.num_polls, self.signals = None, 0, []

    def poll(self):
        self.num_polls += 1
        if self.returncode is None and self.code is not None and self.num_polls > self.ends_after:
            self.returncode = self.code
        assert self.returncode is not None or self.num_polls < self.patience, "the launcher left this rank running"
        return self.returncode

    def kill(self):
        self.returncode = -9

    def send_signal(self, signum):
        self.signals.append(signum)

    def wait(self):
        return self.returncode


def test_the_launcher_ends_a_groups_other_ranks_at_once_when_its_rank_0_failed(monkeypatch):
    """Rank 0 may fail while the others build their engines, when it cannot tell them to stop (its STOP would
    meet their collectives): the launcher kills them at once, not after RANK_GRACE_S; a rank 0 that ended
    well leaves them the grace to end at its STOP."""
    from batchgen.job import launcher

    monkeypatch.setattr(launcher.time, "sleep", lambda s: None)
    monkeypatch.setattr(launcher, "RANK_GRACE_S", 3600.0)  # were the grace applied, the followers would fail
    failed = [_Rank(2), _Rank(None)]
    ended_well = [_Rank(0), _Rank(0, ends_after=20)]
    assert launcher._wait_groups([failed, ended_well]) == [2, 0]
    assert failed[1].returncode == -9 and ended_well[1].returncode == 0


def test_a_group_whose_rank_0_the_launcher_stopped_after_another_rank_failed_exits_with_that_ranks_code(
        monkeypatch):
    """Rank 1 fails (exit 1) while rank 0 waits in a collective: the launcher sends rank 0 SIGTERM, then kills it
    (-9). The group's code is rank 1's 1, not the -9 (exit 137) of the launcher's own kill."""
    from batchgen.job import launcher

    monkeypatch.setattr(launcher.time, "sleep", lambda s: None)
    monkeypatch.setattr(launcher, "RANK_GRACE_S", 0.0)
    monkeypatch.setattr(launcher, "TERM_DELAY_S", 0.0)
    stuck, failed = _Rank(None), _Rank(1)
    assert launcher._wait_groups([[stuck, failed]]) == [1]
    assert stuck.returncode == -9 and stuck.signals
    assert launcher.exit_code(launcher._wait_groups([[_Rank(3), _Rank(1)]])) == 3  # a failing rank 0's own code

"""The model and the hub: a missing local folder or GGUF file is named, a hub name without a reachable hub fails
in seconds with one line, and GGUF conversions are cached by content."""

from __future__ import annotations

import os
import shutil
import socket
import time

import pytest
from typer.testing import CliRunner

from batchgen import hub
from batchgen.cli import app
from batchgen.errors import JobError
from batchgen.config import SourceSpec
from batchgen.runner import loader
from batchgen.runner.loader import gguf_cache_dir, load_model_and_tokenizer, load_tokenizer_and_config
from batchgen.sources import open_source
from jobutil import seed_rows, write_job, write_jsonl

runner = CliRunner()


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def silent_hub(monkeypatch):
    """Online mode, but the hub endpoint is a local socket that accepts connections and never answers."""
    from huggingface_hub import constants

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setattr(hub, "PROBE_TIMEOUT_S", 0.5)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    yield
    server.close()


# ---- local paths -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gguf_file", [None, "model.gguf"])
def test_a_missing_local_model_folder_is_named_with_or_without_gguf_file(tmp_path, gguf_file):
    missing = str(tmp_path / "no-model")
    with pytest.raises(JobError) as e:
        load_tokenizer_and_config(missing, gguf_file)
    assert str(e.value) == f"model.path: no such folder {missing}"


@pytest.mark.parametrize("path", ["./models/tiny", "~/no/such/model", "models/tiny/v2", "my model"])
def test_paths_that_can_only_be_local_are_never_sent_to_the_hub(path):
    assert hub.looks_local(path)
    with pytest.raises(JobError, match="^model.path: no such folder"):
        loader.locate_model(path)


@pytest.mark.parametrize("name", ["gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct", "org/model.v1-2_b"])
def test_hub_ids_are_not_taken_for_local_paths(name):
    assert not hub.looks_local(name)


def test_a_path_whose_first_folder_exists_is_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert hub.looks_local("models/tiny") and not hub.looks_local("elsewhere/tiny")


def test_a_missing_gguf_file_names_the_file_and_lists_those_there(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "other.Q4.gguf").write_bytes(b"GGUF")
    with pytest.raises(JobError) as e:
        load_tokenizer_and_config(str(tmp_path / "m"), "model.Q8.gguf")
    assert str(e.value) == (f"model.gguf_file: no file 'model.Q8.gguf' in {tmp_path / 'm'}; GGUF files there: "
                            f"other.Q4.gguf")


def test_a_missing_model_folder_in_a_job_exits_2_naming_it(tmp_path, tiny_model_dir):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(2))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl"},
                    model={"path": str(tmp_path / "nope"), "gguf_file": "x.gguf"})
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert result.exit_code == 2 and f"model.path: no such folder {tmp_path / 'nope'}" in result.output


# ---- hub names without a reachable hub ---------------------------------------------------------------------------
def test_a_hub_model_id_offline_fails_in_well_under_5_s_with_one_line(tmp_path, tiny_model_dir, offline):
    write_jsonl(tmp_path / "rows.jsonl", seed_rows(2))
    job = write_job(tmp_path, tiny_model_dir, {"path": "rows.jsonl"}, model={"path": "made-up-org/no-such-model"})
    started = time.monotonic()
    result = runner.invoke(app, ["run", str(job), "--no-progress"])
    assert time.monotonic() - started < 5
    assert result.exit_code == 2, result.output
    message = result.output.strip()
    assert len(message.splitlines()) == 1, message
    assert message.startswith("batchgen: error: model.path 'made-up-org/no-such-model' is not a local path, and "
                              "HF_HUB_OFFLINE is set"), message
    assert "hf download made-up-org/no-such-model --local-dir DIR" in message and "Retry" not in message


def test_a_hub_dataset_name_offline_fails_fast_with_one_line(offline):
    started = time.monotonic()
    with pytest.raises(JobError) as e:
        open_source(SourceSpec(path="made-up-org/no-such-dataset", type="hf"))
    assert time.monotonic() - started < 5
    assert str(e.value).startswith("source.path 'made-up-org/no-such-dataset' is not a local path, and "
                                   "HF_HUB_OFFLINE is set")
    assert "save_to_disk(DIR)" in str(e.value)


def test_a_missing_local_dataset_folder_is_named(tmp_path):
    with pytest.raises(JobError) as e:
        open_source(SourceSpec(path=str(tmp_path / "no-dataset"), type="hf"))
    assert str(e.value) == f"source.path: no such folder or file {tmp_path / 'no-dataset'}"


def test_a_hub_that_does_not_answer_fails_within_the_probe_timeout(silent_hub):
    for call, key in [(lambda: loader.locate_model("made-up-org/no-such-model"), "model.path"),
                      (lambda: open_source(SourceSpec(path="made-up-org/no-such-dataset", type="hf")), "source.path")]:
        started = time.monotonic()
        with pytest.raises(JobError) as e:
            call()
        assert time.monotonic() - started < 3
        assert str(e.value).startswith(f"{key} 'made-up-org/no-such-")
        assert "cannot be reached (no answer within 0.5 s" in str(e.value) and "HF_HUB_OFFLINE=1" in str(e.value)


# ---- the GGUF conversion cache is keyed by content ---------------------------------------------------------------
def _clone(tmp_path, name: str, content: bytes) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model.gguf").write_bytes(content)
    return str(folder)


def test_clones_of_one_gguf_file_share_one_conversion_and_other_content_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    a = _clone(tmp_path, "clone-a", b"GGUF" + bytes(range(256)) * 100)
    time.sleep(0.01)
    b = _clone(tmp_path, "clone-b", b"GGUF" + bytes(range(256)) * 100)
    c = _clone(tmp_path, "other", b"GGUF" + bytes(range(255, -1, -1)) * 100)
    dir_a = gguf_cache_dir(loader.locate_model(a, "model.gguf")[1])
    assert dir_a.parent == tmp_path / "cache" / "gguf"  # BATCHGEN_CACHE is the root
    assert gguf_cache_dir(loader.locate_model(b, "model.gguf")[1]) == dir_a
    assert gguf_cache_dir(loader.locate_model(c, "model.gguf")[1]) != dir_a


def test_a_second_clone_loads_the_first_clones_conversion_without_converting(tmp_path, monkeypatch,
                                                                             tiny_model_dir):
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    a = _clone(tmp_path, "clone-a", b"GGUF not really, but the same bytes in both clones")
    b = _clone(tmp_path, "clone-b", b"GGUF not really, but the same bytes in both clones")
    shutil.copytree(tiny_model_dir, gguf_cache_dir(loader.locate_model(a, "model.gguf")[1]))  # clone a, converted
    # These bytes are no GGUF file: converting them would fail, so clone b loads only through the shared entry.
    model, tokenizer = load_model_and_tokenizer(b, "model.gguf", device="cpu")
    assert model.config.num_hidden_layers == 2 and tokenizer.eos_token == "</s>"
    tokenizer, config = load_tokenizer_and_config(b, "model.gguf")
    assert config.num_hidden_layers == 2


def test_a_gguf_file_is_read_in_full_once_per_version(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"version one")
    reads = []
    real = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, name: reads.append(f.name) or real(f, name))
    first = loader.file_digest(path)
    assert loader.file_digest(path) == first == hashlib.sha256(b"version one").hexdigest()
    assert len(reads) == 1
    path.write_bytes(b"version two, longer")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert loader.file_digest(path) == hashlib.sha256(b"version two, longer").hexdigest()
    assert len(reads) == 2

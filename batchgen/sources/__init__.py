"""Sources: stream a dataset's rows in a stable order, in bounded memory. `open_source` picks one."""

from __future__ import annotations

import glob
import importlib
from pathlib import Path

from batchgen.errors import JobError
from batchgen.sources.base import Source, SourceRow, is_output_dir
from batchgen.config import SourceSpec

__all__ = ["SOURCE_TYPES", "Source", "SourceRow", "open_source", "refuse_ignored_keys"]

# source.type -> (module, class, the extension of the files its paths name; None: the class reads spec.path itself).
# A new input format is a module here and its line; config/schema.py's SourceSpec.type lists the same names.
SOURCE_TYPES: dict[str, tuple[str, str, str | None]] = {
    "parquet": ("batchgen.sources.parquet", "ParquetSource", "parquet"),
    "jsonl": ("batchgen.sources.jsonl", "JsonlSource", "jsonl"),
    "openai_batch": ("batchgen.sources.openai_batch", "OpenAIBatchSource", "jsonl"),
    "batchgen_output": ("batchgen.sources.batchgen_output", "OutputDirSource", None),
    "hf": ("batchgen.sources.hf_dataset", "HFDatasetSource", None),
}


def expand_files(paths: str | list[str], what: str) -> list[str]:
    """Sorted files matched by the paths/globs; an error naming any pattern that matched nothing."""
    patterns = [paths] if isinstance(paths, str) else paths
    files: list[str] = []
    for pattern in patterns:
        p = Path(pattern).expanduser()
        if p.is_dir():
            matched = sorted(str(f) for f in p.rglob(f"*.{what}") if f.is_file())
        else:
            matched = sorted(glob.glob(str(p), recursive=True))
        if not matched:
            raise JobError(f"source.path {pattern!r} matches no {what} files"
                           + ("" if Path(pattern).parent.exists() else f" (folder {Path(pattern).parent} does not exist)"))
        files += matched
    return files


def infer_type(spec: SourceSpec) -> str:
    if spec.type is not None:
        return spec.type
    first = spec.path if isinstance(spec.path, str) else spec.path[0]
    lower = first.lower()
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith((".jsonl", ".ndjson", ".json", ".jsonl.gz")):
        return "jsonl"
    p = Path(first)
    if is_output_dir(p):  # a batchgen output: its committed completions, never its rejects or leftovers
        return "batchgen_output"
    if p.is_dir() and not (p / "dataset_info.json").exists() and not (p / "state.json").exists() \
            and not (p / "dataset_dict.json").exists():
        if any(p.rglob("*.parquet")):
            return "parquet"
        if any(p.rglob("*.jsonl")):
            return "jsonl"
    return "hf"


HF_ONLY_KEYS = ("split", "name", "streaming")  # SourceSpec keys that only a Hugging Face dataset reads


def refuse_ignored_keys(spec: SourceSpec) -> None:
    """For a job about to run (or be validated): source.split / name / streaming away from their defaults on another
    kind of source would be ignored without a word, so they are refused, naming them. (Compared with the defaults,
    not model_fields_set: a spec rebuilt from a saved job file holds every key. Readers of a finished output, such
    as status and export, open its saved job's source without this check: an output begun before it stays readable.)"""
    kind = infer_type(spec)
    given = [k for k in HF_ONLY_KEYS if getattr(spec, k) != SourceSpec.model_fields[k].default]
    if kind != "hf" and given:
        keys = ", ".join(f"source.{k}" for k in given)
        raise JobError(f"{keys} {'applies' if len(given) == 1 else 'apply'} to Hugging Face datasets only, but "
                       f"source.path {spec.path!r} is read as {kind}; remove {'it' if len(given) == 1 else 'them'}")


def open_source(spec: SourceSpec) -> Source:
    kind = infer_type(spec)
    module, name, extension = SOURCE_TYPES[kind]
    cls = getattr(importlib.import_module(module), name)  # imported when used: hf's needs `datasets`
    return cls(expand_files(spec.path, extension), spec) if extension else cls(spec)

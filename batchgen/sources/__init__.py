"""Sources: stream a dataset's rows in a stable order, in bounded memory. `open_source` picks one."""

from __future__ import annotations

import glob
import importlib
import os
from pathlib import Path

from batchgen.errors import JobError
from batchgen.output.layout import is_output
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


# the files a folder source reads, by kind. A folder's .json files are not rows: sidecars (stats, Delta logs, dataset
# infos) and JSON arrays (read through `datasets`) sit beside data files; name a .json file to read it as JSON lines.
FOLDER_SUFFIXES = {"parquet": (".parquet",), "jsonl": (".jsonl", ".ndjson", ".jsonl.gz")}


def folder_files(folder: Path) -> dict[str, list[str]]:
    """The data files under `folder`, by kind, each list sorted. Folders that are batchgen outputs
    (output/layout.is_output) are not walked: their shards, manifests and logs are no one's input rows, and a job
    whose output lies inside its source folder would otherwise read its own output as input."""
    found: dict[str, list[str]] = {kind: [] for kind in FOLDER_SUFFIXES}
    for root, dirs, names in os.walk(folder):
        here = Path(root)
        dirs[:] = [d for d in dirs if not is_output(here / d)]
        for name in names:
            kind = next((k for k, sfx in FOLDER_SUFFIXES.items() if name.lower().endswith(sfx)), None)
            if kind is not None and (here / name).is_file():
                found[kind].append(str(here / name))
    return {kind: sorted(files) for kind, files in found.items()}


def _one_kind(pattern: str, found: dict[str, list[str]]) -> None:
    """JobError when a folder holds data files of several kinds or names (.jsonl beside .jsonl.gz: often one data
    twice): reading all would repeat rows, reading one would silently drop the others."""
    kinds = sorted({next(sfx for sfx in FOLDER_SUFFIXES[k] if f.lower().endswith(sfx)) for k, files in found.items()
                    for f in files})
    if len(kinds) > 1:
        first = {sfx: next(f for files in found.values() for f in files if f.lower().endswith(sfx)) for sfx in kinds}
        listed = ", ".join(f"{sfx} ({first[sfx]})" for sfx in kinds)
        raise JobError(f"source.path {pattern!r} is a folder holding data files of several kinds: {listed}. A folder "
                       f"source reads one kind; name the files (a glob such as "
                       f"{str(Path(pattern) / '**' / ('*' + kinds[0]))!r}, or a list)")


def expand_files(paths: str | list[str], what: str) -> list[str]:
    """Sorted files matched by the paths/globs (a folder: its `what` files, folder_files); an error naming any
    pattern that matched nothing."""
    patterns = [paths] if isinstance(paths, str) else paths
    files: list[str] = []
    for pattern in patterns:
        p = Path(pattern).expanduser()
        if p.is_dir():
            found = folder_files(p)
            _one_kind(pattern, {what: found[what]})  # an inferred type was checked across kinds (infer_type)
            matched = found[what]
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
    if lower.endswith((*FOLDER_SUFFIXES["jsonl"], ".json")):
        return "jsonl"
    p = Path(first)
    if is_output_dir(p):  # a batchgen output: its committed completions, never its rejects or leftovers
        return "batchgen_output"
    if p.is_dir() and not (p / "dataset_info.json").exists() and not (p / "state.json").exists() \
            and not (p / "dataset_dict.json").exists():
        found = folder_files(p)
        _one_kind(first, found)
        if found["parquet"]:
            return "parquet"
        if found["jsonl"]:
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

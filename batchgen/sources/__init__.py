"""Sources: stream a dataset's rows in a stable order, in bounded memory. `open_source` picks one."""

from __future__ import annotations

import glob
from pathlib import Path

from batchgen.errors import JobError
from batchgen.sources.base import Source, SourceRow, is_output_dir
from batchgen.job.spec import SourceSpec

__all__ = ["Source", "SourceRow", "open_source"]


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


def open_source(spec: SourceSpec) -> Source:
    kind = infer_type(spec)
    if kind == "parquet":
        from batchgen.sources.parquet import ParquetSource

        return ParquetSource(expand_files(spec.path, "parquet"), spec)
    if kind == "jsonl":
        from batchgen.sources.jsonl import JsonlSource

        return JsonlSource(expand_files(spec.path, "jsonl"), spec)
    if kind == "openai_batch":
        from batchgen.sources.openai_batch import OpenAIBatchSource

        return OpenAIBatchSource(expand_files(spec.path, "jsonl"), spec)
    if kind == "batchgen_output":
        from batchgen.sources.batchgen_output import OutputDirSource

        return OutputDirSource(spec)
    from batchgen.sources.hf_dataset import HFDatasetSource

    return HFDatasetSource(spec)

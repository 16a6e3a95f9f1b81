"""Hugging Face datasets: a save_to_disk folder, local data files through `datasets`, or a hub name.

Splits of a save_to_disk folder: a DatasetDict folder has the splits it was saved with; a folder holding a
single Dataset has exactly one split, named after the split it was made from (Dataset.split) or `train`
when it records none. source.split must name a split that exists; anything else is an error listing them."""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path

from batchgen.errors import JobError
from batchgen.hub import hub_offline, looks_local, offline_miss, require_hub
from batchgen.sources.base import Source, SourceRow
from batchgen.config import SourceSpec

SAVE_TO_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
DATASET_LOCAL_HINT = ("Save it where the hub is reachable (datasets.load_dataset({name!r}).save_to_disk(DIR)) and "
                      "set source.path to DIR")


def _from_disk(path: Path, split: str):
    """The split `split` of a save_to_disk folder."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise JobError(f"source.split {split!r} is not a split of dataset {path}; splits: {', '.join(ds)}")
        return ds[split]
    only = str(ds.split) if ds.split is not None else "train"
    if split != only:
        raise JobError(f"source.split {split!r} is not a split of dataset {path}: it holds a single Dataset, whose "
                       f"one split is {only!r}; set source.split: {only}")
    return ds


def _load(path: str, spec: SourceSpec):
    """A local data-file folder or a hub dataset through datasets.load_dataset."""
    import datasets

    local = Path(path).expanduser()
    matched = sorted(f for f in glob.glob(str(local)) if Path(f).is_file()) if glob.has_magic(str(local)) else []
    if local.is_file() or matched:  # a file no reader takes by its name: datasets reads folders and hub names
        named = local if local.is_file() else matched[0]
        raise JobError(f"source.path {path!r} {'is' if local.is_file() else 'matches'} {named}, a file batchgen does "
                       f"not read by its name: it reads .parquet, .jsonl, .ndjson, .json and .jsonl.gz files (set "
                       f"source.type: jsonl or parquet for other names of those formats; other compression or "
                       f"formats: convert first), save_to_disk folders and hub dataset names")
    if not local.exists():
        if looks_local(path):
            raise JobError(f"source.path: no such folder or file {path}")
        require_hub("source.path", path, DATASET_LOCAL_HINT.format(name=path))
    try:
        return datasets.load_dataset(str(local) if local.exists() else path, spec.name, split=spec.split,
                                     streaming=spec.streaming)
    except ConnectionError:
        if hub_offline():  # offline mode and no cached copy
            raise offline_miss("source.path", path, DATASET_LOCAL_HINT.format(name=path)) from None
        raise
    except ValueError as e:
        if "Unknown split" in str(e) or "Bad split" in str(e):  # datasets' words (not streaming / streaming)
            raise JobError(f"source.split {spec.split!r} is not a split of dataset {path!r} ({e})") from None
        raise


class HFDatasetSource(Source):
    def __init__(self, spec: SourceSpec) -> None:
        super().__init__(spec.limit, spec.key_column)
        import datasets

        if not isinstance(spec.path, str) and len(spec.path) != 1:  # only the first one would be read
            raise JobError(f"source.path lists {len(spec.path)} paths, read as Hugging Face datasets: such a source "
                           f"is one dataset (a save_to_disk folder or a hub name). Concatenate them into one "
                           f"(datasets.concatenate_datasets, then save_to_disk), or run a job for each")
        path = spec.path if isinstance(spec.path, str) else spec.path[0]
        self.description = f"dataset {path!r} (split {spec.split!r})"
        folder = Path(path).expanduser()
        try:
            if folder.is_dir() and any((folder / f).exists() for f in SAVE_TO_DISK_MARKERS):
                if spec.name is not None or not spec.streaming:  # neither means anything to a saved dataset
                    key = "source.name" if spec.name is not None else "source.streaming"
                    raise JobError(f"{key} applies to hub datasets and data-file folders; {path} is a "
                                   f"save_to_disk folder, read as saved (its splits: source.split): remove {key}")
                ds = _from_disk(folder, spec.split)
            else:
                ds = _load(path, spec)
        except JobError:
            raise
        except Exception as e:  # datasets raises many types: missing hub, bad split, bad files
            raise JobError(f"cannot open {self.description}: {type(e).__name__}: {e}") from None
        self.dataset = ds
        features = ds.features
        if features is None:  # some streaming datasets only know their features after the first row
            first = next(iter(ds), None)
            if first is None:
                raise JobError(f"{self.description} is empty")
            features = datasets.Features.from_arrow_schema(datasets.Dataset.from_list([first]).data.schema)
        self.schema = features.arrow_schema
        self.num_rows = getattr(ds, "num_rows", None)
        if self.num_rows == 0:
            raise JobError(f"{self.description} is empty")
        self.check_key_column()

    def _iter_all(self) -> Iterator[SourceRow]:
        for position, columns in enumerate(self.dataset):
            yield SourceRow(position, dict(columns))

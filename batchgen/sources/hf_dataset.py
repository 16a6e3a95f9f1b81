"""Hugging Face datasets: a save_to_disk folder, local data files through `datasets`, or a hub name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from batchgen.errors import JobError
from batchgen.sources.base import Source, SourceRow
from batchgen.job.spec import SourceSpec


class HFDatasetSource(Source):
    def __init__(self, spec: SourceSpec) -> None:
        super().__init__(spec.limit, spec.key_column)
        import datasets

        path = spec.path if isinstance(spec.path, str) else spec.path[0]
        self.description = f"dataset {path!r} (split {spec.split!r})"
        try:
            if Path(path).is_dir() and any((Path(path) / f).exists() for f in
                                           ("dataset_info.json", "state.json", "dataset_dict.json")):
                ds = datasets.load_from_disk(path)
                if isinstance(ds, datasets.DatasetDict):
                    if spec.split not in ds:
                        raise JobError(f"{self.description}: no split {spec.split!r}; splits: {', '.join(ds)}")
                    ds = ds[spec.split]
            else:
                ds = datasets.load_dataset(path, spec.name, split=spec.split, streaming=spec.streaming)
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

"""Where a job's own files lie relative to its output folder: the job file and the source may not be among
what batchgen writes, and an output folder shared with them cannot be started over.

Refused for every run: a source file (or a source glob's folder) inside one of batchgen's folders of the output
(`data/`, `rejects/`, `manifest/`, `logs/`, `reports/`): the shards would mix with the input, and `--fresh`
would delete it; a source that is the output folder itself (a chained job reading what it writes).
For a plain run, the job file or the source elsewhere inside the output folder is a warning; for `--fresh`
it is a reason named in the refusal (output/fresh.py).
"""

from __future__ import annotations

import glob
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.errors import JobError
from batchgen.output import layout

_GLOB_CHARS = "*?["
MAX_NAMED = 4  # paths named in a warning (then a count)


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def source_paths(source_path: str | list[str]) -> list[tuple[Path, bool]]:
    """(path, is_glob_root) for the local files and folders a source names (a glob: its matches, and the folder
    it is rooted in); hub names and URLs are not local (load_spec made local paths absolute)."""
    found = []
    for p in [source_path] if isinstance(source_path, str) else source_path:
        if "://" in p or not Path(p).is_absolute():
            continue
        if any(c in p for c in _GLOB_CHARS):
            parts = Path(p).parts
            static = next(i for i, part in enumerate(parts) if any(c in part for c in _GLOB_CHARS))
            found.append((Path(*parts[:static]), True))
            found += [(Path(m), False) for m in glob.glob(p, recursive=True)]
        else:
            found.append((Path(p), False))
    return [(f.resolve(), root) for f, root in found]


@dataclass
class Placement:
    out_dir: Path
    inside: list[str] = field(default_factory=list)  # "the job file X", "the source X" lying in out_dir

    def warning(self) -> str | None:
        if not self.inside:
            return None
        named = ", ".join(self.inside[:MAX_NAMED]) + (f" and {len(self.inside) - MAX_NAMED} more"
                                                      if len(self.inside) > MAX_NAMED else "")
        return (f"batchgen: warning: output.dir {self.out_dir} also holds {named}; batchgen "
                f"writes its files beside them ({layout.RESOLVED_JOB_FILE}, data/, manifest/, ...) and never "
                f"deletes them, so `--fresh` will refuse this folder. An output folder of its own (output.dir, "
                f"e.g. out/NAME) is safer")


def check(out_dir: Path, source_path: str | list[str], job_file: Path | None) -> Placement:
    """JobError for a source among batchgen's files (see the module docstring); else what lies inside."""
    out_dir = out_dir.resolve()
    placement = Placement(out_dir)
    for src, glob_root in source_paths(source_path):
        if src == out_dir and not glob_root:
            raise JobError(f"source.path {src} is the output folder itself: a job cannot read what it writes. "
                           f"Give output.dir (or --output) another folder")
        for name in layout.OWNED_DIRS:
            if _inside(src, out_dir / name):
                raise JobError(f"source.path {src} lies in {out_dir / name}, a folder where batchgen writes its "
                               f"own files: its shards would mix with the input, and `--fresh` could not tell "
                               f"them apart. Give the job an output folder of its own (output.dir or --output, "
                               f"e.g. out/NAME)")
        if not glob_root and _inside(src, out_dir) and f"the source {src}" not in placement.inside:
            placement.inside.append(f"the source {src}")
    if job_file is not None and _inside(Path(job_file).resolve(), out_dir):
        placement.inside.insert(0, f"the job file {Path(job_file).resolve()}")
    return placement

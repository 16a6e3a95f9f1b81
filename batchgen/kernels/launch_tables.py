"""Launch tables: measured kernel launches shipped as JSON beside the kernels that use them, read here.

A table is {"about": str, "entries": [...]}; each entry names the shape it was measured at and the GPU it was
measured on (`device`: torch.cuda.get_device_name()). Each kernel's module validates its entries with
`check_keys` and decides how to look them up. A file is read once a process, so a shape always gets the same
launch (CUDA graphs captured for it stay valid). Tables are tuned on one GPU model today (the H200); their
entries are used on any device, where they are at worst a fair launch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path


@functools.lru_cache(maxsize=16)
def read_entries(path: Path | str) -> tuple[dict, ...]:
    """The entries of a table file, as JSON objects (ValueError naming the file when it is not a table)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path}: not a launch table (an object with an 'entries' list)")
    for i, raw in enumerate(data["entries"]):
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: entry {i}: not an object")
    return tuple(data["entries"])


def check_keys(obj: dict, spec: dict[str, tuple[Callable[[object], bool], str]], where: str, prefix: str = "") -> None:
    """ValueError naming `where` and the key when `obj` has a key `spec` lacks, lacks one, or one fails its check."""
    unknown = sorted(obj.keys() - spec.keys())
    if unknown:
        raise ValueError(f"{where}: key {prefix + unknown[0]!r} is not one of {', '.join(spec)}")
    for key, (ok, what) in spec.items():
        if key not in obj:
            raise ValueError(f"{where}: key {prefix + key!r} is missing")
        if not ok(obj[key]):
            raise ValueError(f"{where}: key {prefix + key!r} is {obj[key]!r}, not {what}")

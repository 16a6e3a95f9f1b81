"""The FP8 GEMMs' measured launches (gemm_launches.json beside this file, read once through
kernels/launch_tables.py): the Triton GEMM's configs per weight shape and row bucket, and the weight shapes the
split-K GEMM takes beyond its default row limit."""

from __future__ import annotations

from pathlib import Path

from batchgen.kernels.launch_tables import check_keys, read_entries

TABLE_PATH = Path(__file__).with_name("gemm_launches.json")

_POSITIVE_INT = (lambda v: type(v) is int and v >= 1, "an int >= 1")
_NUMBER = (lambda v: type(v) in (int, float) and v > 0, "a number > 0")
_ENTRY_KEYS = {
    "kernel": (lambda v: v in ("triton", "splitk"), "'triton' or 'splitk'"),
    "n": _POSITIVE_INT, "k": _POSITIVE_INT, "max_rows": _POSITIVE_INT,
    "config": (lambda v: v is None or isinstance(v, dict), "null or an object of GemmConfig fields"),
    "us": _NUMBER, "baseline_us": _NUMBER,
    "baseline": (lambda v: isinstance(v, str), "a string"),
    "device": (lambda v: isinstance(v, str), "a string"),
    "what": (lambda v: isinstance(v, str), "a string"),
}
_CONFIG_KEYS = {name: _POSITIVE_INT for name in ("block_m", "block_n", "group_m", "warps", "stages")}


def load(config_type, path: Path | str = TABLE_PATH) -> tuple[dict, dict]:
    """(shape configs: (N, K) -> {M bucket: config_type}, split-K rows: (N, K) -> rows), validated: ValueError
    naming the file, the entry and the key."""
    shape_configs: dict[tuple[int, int], dict[int, object]] = {}
    splitk_rows: dict[tuple[int, int], int] = {}
    for i, raw in enumerate(read_entries(path)):
        where = f"{path}: entry {i}"
        check_keys(raw, _ENTRY_KEYS, where)
        shape = (raw["n"], raw["k"])
        if raw["kernel"] == "triton":
            if raw["config"] is None:
                raise ValueError(f"{where}: key 'config' is missing (a 'triton' entry's launch)")
            check_keys(raw["config"], _CONFIG_KEYS, where, "config.")
            shape_configs.setdefault(shape, {})[raw["max_rows"]] = config_type(**raw["config"])
        elif shape in splitk_rows:
            raise ValueError(f"{where}: key 'n': the split-K rows of shape {shape} are also an earlier entry's")
        else:
            splitk_rows[shape] = raw["max_rows"]
    return shape_configs, splitk_rows

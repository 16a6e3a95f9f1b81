"""Compare two batchgen output directories row by row: how many completions are identical, and where the others
part (the first differing token's position, percentiles).

    python bench/compare_outputs.py OUT_A OUT_B [--require-identical]

Rows are matched by (row key, sample_idx); the key column is read from OUT_A's fingerprint.json (row_idx when the
job has no key_column). Completions are compared as token ids when both outputs kept them
(`output.keep_token_ids: true`, e.g. `batchgen bench --workload job --job-set output.keep_token_ids=true`), else
as text (positions are then characters). `--require-identical` exits 1 unless every common row is identical and
both outputs hold the same rows (for scripts: deterministic mode's claim).
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq


def key_column(out_dir: Path) -> str:
    path = out_dir / "fingerprint.json"
    if path.is_file():
        key = json.loads(path.read_text())["components"].get("row_identity", {}).get("key_column")
        if key:
            return key
    return "row_idx"


def read_completions(out_dir: Path, key: str, field: str) -> dict[tuple, list]:
    """(key, sample_idx) -> the completion's token ids (or text as a list of characters)."""
    files = sorted(glob.glob(str(out_dir / "data" / "*.parquet")))
    if not files:
        sys.exit(f"{out_dir}: no data/*.parquet (not a batchgen output directory?)")
    rows = {}
    for f in files:
        for r in pq.read_table(f, columns=[key, "sample_idx", field]).to_pylist():
            value = r[field]
            rows[(r[key], r["sample_idx"])] = list(value) if value is not None else []
    return rows


def has_column(out_dir: Path, name: str) -> bool:
    files = sorted(glob.glob(str(out_dir / "data" / "*.parquet")))
    return bool(files) and name in pq.read_schema(files[0]).names


def first_difference(a: list, b: list) -> int:
    """The first position where a and b differ (the shorter's length when one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def percentile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def compare(out_a: Path, out_b: Path) -> dict:
    key = key_column(out_a)
    ids = has_column(out_a, "completion_token_ids") and has_column(out_b, "completion_token_ids")
    field = "completion_token_ids" if ids else "completion"
    a, b = read_completions(out_a, key, field), read_completions(out_b, key, field)
    common = sorted(set(a) & set(b), key=repr)
    differing = sorted(first_difference(a[k], b[k]) for k in common if a[k] != b[k])
    return {
        "compared": "token ids" if ids else "text (characters; keep_token_ids was off)",
        "rows_a": len(a), "rows_b": len(b), "common": len(common),
        "only_in_a": len(set(a) - set(b)), "only_in_b": len(set(b) - set(a)),
        "identical": len(common) - len(differing),
        "first_difference_p10_p50_p90": [percentile(differing, q) for q in (0.1, 0.5, 0.9)] if differing else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_a", type=Path)
    parser.add_argument("out_b", type=Path)
    parser.add_argument("--require-identical", action="store_true")
    args = parser.parse_args()
    r = compare(args.out_a, args.out_b)
    share = r["identical"] / r["common"] if r["common"] else 0.0
    print(f"compared {r['compared']}: {r['rows_a']} rows in A, {r['rows_b']} in B, {r['common']} in both "
          f"({r['only_in_a']} only in A, {r['only_in_b']} only in B)")
    print(f"identical completions: {r['identical']} / {r['common']} ({100 * share:.1f} %)")
    if r["first_difference_p10_p50_p90"]:
        print("first differing position p10 / p50 / p90: " + " / ".join(map(str, r["first_difference_p10_p50_p90"])))
    print(json.dumps(r))
    if args.require_identical and (r["identical"] != r["common"] or r["only_in_a"] or r["only_in_b"]):
        sys.exit(1)


if __name__ == "__main__":
    main()

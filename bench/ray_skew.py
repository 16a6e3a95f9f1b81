"""The straggler effect on CPU: a job whose few very long rows sit together (the first rows of the source), run
by two workers with the fixed partition (`--workers 2`: each takes a contiguous half) and by Ray dealing
(`--ray --workers 2`: units handed out as workers free up). Prints and writes (--json) the wall time of each
command and each worker's loop time.

    .venv/bin/python bench/ray_skew.py --json /tmp/ray_skew.json

A tiny random Llama (the tests' model) on the CPU, one thread per worker (OMP_NUM_THREADS=1) in both modes;
the long rows have min_new_tokens = max_new_tokens (a fixed length), the others 16 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from jobutil import read_rows, save_tiny_model, seed_rows, write_job, write_jsonl  # noqa: E402


def _rows(num_rows: int, num_long: int, long_tokens: int) -> list[dict]:
    rows = seed_rows(num_rows)
    for i, r in enumerate(rows):
        n = long_tokens if i < num_long else 16
        r["sampling"] = json.dumps({"max_new_tokens": n, "min_new_tokens": n})
    return rows


def _run(job: Path, out: Path, *extra: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "batchgen.cli", "run", str(job), "-o", str(out), "--no-progress",
                           *extra], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(extra)} failed:\n{done.stderr[-3000:]}")
    workers = {}
    for report in sorted((out / "reports").glob("w*.json")):
        r = json.loads(report.read_text())
        workers[report.stem] = {"loop_wall_s": r["wall_s"], "setup_s": r["setup_s"],
                                "rows_committed": r["rows_committed"], "generated_tokens": r["generated_tokens"]}
    return {"command_wall_s": round(wall, 2), "rows": len(read_rows(out)), "workers": workers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--long-rows", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = save_tiny_model(tmp)
        write_jsonl(tmp / "rows.jsonl", _rows(args.rows, args.long_rows, args.long_tokens))
        job = write_job(tmp, model, {"path": "rows.jsonl", "key_column": "id", "sampling_column": "sampling"},
                        sampling={"temperature": 0.8, "max_new_tokens": 16}, engine={"max_num_seqs": 8},
                        output={"rows_per_shard": 50, "report": False})
        results = {"static": _run(job, tmp / "static", "--workers", "2"),
                   "ray": _run(job, tmp / "ray", "--ray", "--workers", "2")}
    results["settings"] = vars(args) | {"json": str(args.json) if args.json else None}
    for mode in ("static", "ray"):
        r = results[mode]
        loops = ", ".join(f"{w} {v['loop_wall_s']:.1f} s ({v['rows_committed']} rows)" for w, v in r["workers"].items())
        print(f"{mode:>6}: command {r['command_wall_s']:.1f} s; worker loops: {loops}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

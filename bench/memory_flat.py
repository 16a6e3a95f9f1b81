"""Host memory over a large source: stream a generated Parquet file through `batchgen run` with a tiny model
and max_new_tokens 1, and record the peak RSS of the run at several source sizes (it must not grow with the
row count). Not a test: it takes minutes.

    .venv/bin/python bench/memory_flat.py --sizes 10000,100000,1000000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def write_rows(path: Path, n: int) -> None:
    writer = None
    for start in range(0, n, 100_000):
        ids = range(start, min(n, start + 100_000))
        table = pa.table({"id": pa.array([f"row-{i:08d}" for i in ids]),
                          "text": pa.array([f"Say something about item {i}." for i in ids])})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,100000,1000000")
    args = ap.parse_args()
    from jobutil import save_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="batchgen-mem-"))
    model = save_tiny_model(tmp)
    results = []
    for n in map(int, args.sizes.split(",")):
        src = tmp / f"rows-{n}.parquet"
        write_rows(src, n)
        job = tmp / f"job-{n}.yaml"
        job.write_text(yaml.safe_dump({
            "model": {"path": model, "device": "cpu"},
            "source": {"path": str(src), "key_column": "id"},
            "prompt": {"column": "text", "chat": False},
            "sampling": {"max_new_tokens": 1, "temperature": 0.0},
            "engine": {"max_num_seqs": 256, "max_num_batched_tokens": 4096, "num_kv_blocks": 2048},
            "output": {"dir": str(tmp / f"out-{n}"), "rows_per_shard": 10000, "keep_columns": "none"},
        }))
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "batchgen.cli", "run", str(job), "--no-progress"], cwd=REPO,
                           capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(p.stderr[-2000:])
        out = tmp / f"out-{n}"
        report = json.loads((out / "reports" / "w00000.json").read_text())
        rss = [json.loads(line)["rss_mib"] for line in (out / "logs" / "throughput-w00000.jsonl").read_text().splitlines()]
        results.append({"rows": n, "wall_s": round(wall, 1), "peak_rss_mib": report["peak_rss_mib"],
                        "rss_mib_first_log": rss[0], "rss_mib_last_log": rss[-1], "rss_mib_max_log": max(rss),
                        "rows_committed": report["rows_committed"]})
        print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()

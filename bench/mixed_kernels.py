"""Where the mixed load's device time goes, kernel by kernel: the load's first `--requests` requests
(batchgen.bench.mixed.mixed_workload, greedy, 256 sequences, 8,192 batched tokens: the `batchgen bench --workload
mixed` engine) run once under torch.profiler (device activity only), every kernel's total time and count written
to --json, with the device's idle stretches between kernels charged to the kernel each one waited for. Run it from
two checkouts and `--compare A.json B.json` ranks the kernels (and the idle before them) by how much more time B
spent: the tool that finds a regression between two commits when their schedules are the same. Kernel times do not
depend on Triton's disk cache; the idle does (a build in the loop is idle before the kernel built).

It uses only what every batchgen since 2026-12-01 has (Engine, EngineConfig, SamplingParams, bench.seed's
build_model, bench.mixed's mixed_workload), so it profiles an older checkout too: run it with that checkout's
folder first on PYTHONPATH (the script's own folder, bench/, holds no batchgen), e.g.

    cd .prev && PYTHONPATH=/tmp/site:$PWD python3 ../bench/mixed_kernels.py --requests 400 --json prev.json
    PYTHONPATH=/tmp/site:$PWD python3 bench/mixed_kernels.py --requests 400 --json this.json
    python3 bench/mixed_kernels.py --compare prev.json this.json

Its default warm-up is what every checkout's bench had (two of the load's requests, four tokens each), so it is the
same for both sides of a comparison; those two prompts' full blocks stay in the prefix cache for the profiled run.
On a machine whose Triton cache is empty that leaves builds inside the profiled run, seen as idle before the kernel
built (2026-12-02: 4.06 s before `_prefill_kernel`); `--warmup load` warms up on the load's first 64 requests as
`batchgen bench --workload mixed` does (prompts reversed, outputs cut to 64 tokens), so the idle is the load's own.
Needs a CUDA GPU (the compare mode does not).
"""

from __future__ import annotations

import argparse
import json
import time


WARMUP_LOAD_REQUESTS = 64  # --warmup load: as batchgen.bench.mixed's warm-up (kept here: old checkouts lack it)
WARMUP_LOAD_TOKENS = 64


def profile_load(requests: int, max_num_seqs: int = 256, warmup: str = "short") -> dict:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import batchgen
    from batchgen.bench.mixed import mixed_workload
    from batchgen.bench.seed import build_model
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.engine import Engine
    from batchgen.sampling_params import SamplingParams

    model = build_model()
    prompts, output_lens = mixed_workload(requests)
    engine = Engine(model, None, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                                              cuda_graphs=True, async_pipeline=True))
    if warmup == "load":  # the prompts reversed: nothing the profiled run's prefix cache can hit
        warm = min(WARMUP_LOAD_REQUESTS, len(prompts))
        engine.generate([p[::-1] for p in prompts[:warm]],
                        [SamplingParams(max_new_tokens=min(n, WARMUP_LOAD_TOKENS), temperature=0.0, ignore_eos=True)
                         for n in output_lens[:warm]])
    else:
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    steps0 = engine.num_steps
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = {}
    for avg in prof.key_averages():
        us = avg.self_device_time_total
        if us > 0:
            kernels[avg.key] = {"us": us, "count": avg.count}
    intervals = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return {"batchgen": batchgen.__file__, "gpu": torch.cuda.get_device_name(0), "requests": requests, "warmup": warmup,
            "steps": engine.num_steps - steps0, "wall_s_profiled": wall,
            "device_s": sum(k["us"] for k in kernels.values()) / 1e6, "kernels": kernels,
            "gaps": gaps_by_next_kernel(intervals)}


def gaps_by_next_kernel(intervals: list[tuple[str, float, float]], long_us: float = 100.0) -> dict:
    """Where the device sat idle between kernels: each idle stretch (a kernel starting after every earlier one
    ended) charged to the kernel that ended it, the one the device waited for (late from the host: its launch, a
    Triton build, a host sync before it). intervals: (name, start µs, end µs) of every device activity. Returns
    {"idle_us": total, "by_kernel": {name: {"us", "count", "count_over_long"}}} (count_over_long: stretches of
    more than long_us)."""
    by_kernel: dict[str, dict] = {}
    idle, busy_until = 0.0, None
    for name, start, end in sorted(intervals, key=lambda t: t[1]):
        if busy_until is not None and start > busy_until:
            gap = start - busy_until
            idle += gap
            k = by_kernel.setdefault(name, {"us": 0.0, "count": 0, "count_over_long": 0})
            k["us"] += gap
            k["count"] += 1
            k["count_over_long"] += gap > long_us
        busy_until = end if busy_until is None else max(busy_until, end)
    return {"idle_us": idle, "by_kernel": by_kernel}


def compare(a: dict, b: dict, top: int = 30) -> list[dict]:
    """Kernels ranked by B's time minus A's (names in either), with both times and counts."""
    names = set(a["kernels"]) | set(b["kernels"])
    zero = {"us": 0.0, "count": 0}
    rows = [{"name": n, "a_ms": a["kernels"].get(n, zero)["us"] / 1e3, "b_ms": b["kernels"].get(n, zero)["us"] / 1e3,
             "a_count": a["kernels"].get(n, zero)["count"], "b_count": b["kernels"].get(n, zero)["count"]}
            for n in names]
    for r in rows:
        r["delta_ms"] = r["b_ms"] - r["a_ms"]
    rows.sort(key=lambda r: (-abs(r["delta_ms"]), r["name"]))
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--warmup", choices=("short", "load"), default="short",
                    help="short: two 4-token requests (what old checkouts' benches did); load: 64 of the load's")
    ap.add_argument("--json")
    ap.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"))
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        print(f"A {a['batchgen']}: {a['steps']} steps, device {a['device_s']:.2f} s, wall {a['wall_s_profiled']:.2f} s")
        print(f"B {b['batchgen']}: {b['steps']} steps, device {b['device_s']:.2f} s, wall {b['wall_s_profiled']:.2f} s")
        print(f"{'B - A ms':>10} {'A ms':>10} {'B ms':>10} {'A n':>8} {'B n':>8}  kernel")
        for r in compare(a, b):
            print(f"{r['delta_ms']:>10.1f} {r['a_ms']:>10.1f} {r['b_ms']:>10.1f} {r['a_count']:>8} {r['b_count']:>8}  "
                  f"{r['name'][:110]}")
        if "gaps" in a and "gaps" in b:  # idle stretches, charged to the kernel each one waited for
            print(f"idle between kernels: A {a['gaps']['idle_us'] / 1e3:.1f} ms, B {b['gaps']['idle_us'] / 1e3:.1f} ms")
            for r in compare({"kernels": a["gaps"]["by_kernel"]}, {"kernels": b["gaps"]["by_kernel"]}, top=12):
                print(f"{r['delta_ms']:>10.1f} {r['a_ms']:>10.1f} {r['b_ms']:>10.1f} {r['a_count']:>8} "
                      f"{r['b_count']:>8}  idle before {r['name'][:100]}")
        return
    report = profile_load(args.requests, warmup=args.warmup)
    print(f"{report['batchgen']}: {report['steps']} steps, device {report['device_s']:.2f} s, "
          f"wall {report['wall_s_profiled']:.2f} s (profiled)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

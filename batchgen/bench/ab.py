"""A B B A comparisons of bench runs: each variant's mean of one figure, over all its runs and over its warm ones.

A run is cold when Triton built kernels inside its timed loop for more than COLD_BUILD_S seconds: on a fresh machine
Triton's disk cache is empty, so the first run of a command builds every kernel specialisation the warm-up did not
reach (a decode launch for a batch's tail, a prefill pointer's alignment), ~0.8 s each. Measured twice on the H200
(2026-12-02, bench/results/2026-12-02-admission-groups-mixed-job.md): the mixed load's first A run 68.25 s against
66.08 for the last (2.1 s of builds), the job's first run at 256 sequences 19,065 tok/s against 22,118 (2.4 s). Such a
run says nothing about its variant, so the summaries also give B/A over the warm runs alone (with the cold run,
usually the first A, left out, A B B A no longer cancels a drift over the command: read it beside the plain B/A). Runs
without a `triton_compile_s` count as warm.
"""

from __future__ import annotations

COLD_BUILD_S = 0.1  # seconds of Triton builds inside a timed run from which it is cold


def is_cold(run: dict) -> bool:
    return run.get("triton_compile_s", 0.0) > COLD_BUILD_S


def variant_means(runs: list[dict], key: str) -> dict:
    """{"A", "B": mean of `key` over each variant's runs; "A_warm", "B_warm": the same over its warm runs
    (None where a variant has none); "num_cold_runs"}. runs: dicts with "variant" ("A" or "B") and `key`."""
    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    out: dict = {"num_cold_runs": sum(is_cold(r) for r in runs)}
    for v in "AB":
        mine = [r for r in runs if r["variant"] == v]
        out[v] = mean([r[key] for r in mine])
        out[f"{v}_warm"] = mean([r[key] for r in mine if not is_cold(r)])
    return out


def ratio(b: float | None, a: float | None, digits: int | None = 4) -> float | None:
    """b / a rounded to `digits` (None: not rounded), or None when either is missing."""
    if not (a and b):
        return None
    return b / a if digits is None else round(b / a, digits)

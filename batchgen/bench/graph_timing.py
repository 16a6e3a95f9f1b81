"""CUDA-graph capture for the benches' device timings: several calls of one function in a graph, so that replays
time the device's work without host launch overhead. Each bench times the replays its own way (a mean over
back-to-back replays, a median of per-replay events)."""

from __future__ import annotations

import torch


def capture_graph(fn, calls: int, warmup: int = 1) -> torch.cuda.CUDAGraph:
    """A graph of `calls` calls of fn(), after `warmup` eager calls (compiles, autotuning, and communicators or
    buffers created outside the capture) and a sync."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph

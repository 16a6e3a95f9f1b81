"""CUDA-graph capture for the benches' device timings: several calls of one function in a graph, so that replays
time the device's work without host launch overhead. Each bench times the replays its own way (a mean over
back-to-back replays, a median of per-replay events: median_replay_ms)."""

from __future__ import annotations

import statistics

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


def median_replay_ms(graph: torch.cuda.CUDAGraph, calls: int, reps: int) -> float:
    """Per-call device ms of a graph holding `calls` calls: the median over `reps` replays, each between two CUDA
    events, after one untimed replay."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)

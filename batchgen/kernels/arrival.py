"""Arrival counters: the last of N programs that share an output finishes it, instead of a second kernel.

Used where a kernel splits work into N programs that write fp32 partials and a second launch would combine them:
the decode attention's context splits (decode_tiles.merge_if_last, DecodeLaunch.fused_merge) and the FP8 split-K
GEMM's K splits (fp8_splitk, SplitKConfig.fused_reduce). Each group of programs counts its arrivals in one int32;
the program that arrives N-th combines the partials (in a fixed order, so the result does not depend on which
program is last) and resets the count to 0.

Ordering (NVIDIA's memory model, as CUTLASS's split-K semaphore): a CTA barrier makes every warp's partial stores
precede the program's acq_rel atomic (release is cumulative), and the last program's loads follow its acquire;
they bypass L1 (`.cg`), where no stale copy of another SM's writes can sit.

Hazards: the counters (`arrival_counters`, one buffer per device) must be all zeros when a launch starts, which
every launch keeps true by resetting what it counted; two launches that use them at the same time on one device
(two streams) would mix their counts, so callers run on one stream (the engine's compute stream). The buffer is
sized generously at first use so that it exists before any CUDA graph capture (the warm-up runs first).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without Triton use the references
    triton = None

MIN_COUNTERS = 1 << 16  # 256 KB: 512 sequences x 128 KV heads, or 65,536 GEMM tiles

# Per device, the counters in use; invariant: all zeros between launches (see the module docstring)
_COUNTERS: dict[torch.device, torch.Tensor] = {}
# Every buffer ever handed out, kept alive: a CUDA graph captured with an older, smaller buffer keeps its address
_RETIRED: list[torch.Tensor] = []


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed int32 arrival counters on `device`. A larger request replaces the buffer (the old
    one stays allocated for graphs that captured it); not during a CUDA graph capture, where the zero fill would
    only be recorded: there it raises, naming the count (the capture's warm-up normally allocated it)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"arrival counters: {count} needed on {device} during a CUDA graph capture, "
                               f"{0 if buf is None else buf.numel()} allocated; run the launch once before capturing")
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(count, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


if triton is not None:
    @triton.jit
    def arrive_last(counter_ptr, count):
        """Count this program's arrival at counter_ptr; true for the `count`-th (the last), which also resets
        the counter to 0. Call after this program's partial stores; the caller's loads of the others' partials
        go after it, with cache_modifier=".cg"."""
        tl.debug_barrier()  # every warp's stores issued before the release below
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
        last = arrived == count - 1
        if last:
            tl.store(counter_ptr, 0)  # no other program of this launch touches it any more
        return last

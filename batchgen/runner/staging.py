"""StepStaging: a step's host arrays to the device without ever making the host wait for the device.

CUDA performs a copy from pageable host memory synchronously with respect to the host, after everything
queued before it: a plain `tensor.to("cuda")` in step N+1's preparation waits for step N to finish, which
is exactly the overlap the async pipeline exists for. Here every input goes through pinned memory instead:

    host arrays --pack--> pinned host slot --H2D stream--> device slot --(views)--> compute stream

Two slots (A, B) are used alternately, so while the device reads step N's inputs from slot A the host packs
step N+1's into slot B. Events order the reuse of a slot two steps later:
  * `copied` (H2D stream): the pinned bytes have been read -> the host may overwrite the pinned slot;
  * `consumed` (compute stream): the step that reads the device slot has run -> the next copy may land.
With at most two steps in flight both waits are already satisfied when they are reached: the host does not
block on them in steady state.

On CPU the arrays are wrapped without a copy (`torch.from_numpy`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 16  # bytes: every array starts aligned for any dtype view


@dataclass
class _Slot:
    host: torch.Tensor  # [capacity] uint8, pinned
    device: torch.Tensor  # [capacity] uint8
    copied: torch.cuda.Event  # recorded on the H2D stream after the copy out of `host`
    consumed: torch.cuda.Event  # recorded on the compute stream after the step that reads `device`


class StepStaging:
    def __init__(self, device: torch.device, compute_stream: torch.cuda.Stream | None,
                 capacity_bytes: int = 1 << 20) -> None:
        self.device = device
        self.compute_stream = compute_stream
        self.h2d_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.slots: list[_Slot] = []
        self._current: _Slot | None = None  # the slot of the step being prepared
        self._next = 0
        if self.h2d_stream is not None:
            self._allocate(capacity_bytes)

    def _allocate(self, capacity_bytes: int) -> None:
        torch.cuda.synchronize(self.device)  # the old slots may still be in use (growth is rare)
        self.slots = [_Slot(torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True),
                            torch.empty(capacity_bytes, dtype=torch.uint8, device=self.device),
                            torch.cuda.Event(), torch.cuda.Event()) for _ in range(2)]

    def to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors holding `arrays`, ready for the compute stream. One copy per call; a step may call
        this more than once (its inputs, then its sampling tensors) between `begin_step` and `end_step`."""
        if self.h2d_stream is None:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        assert self._current is not None, "to_device outside begin_step/end_step"
        sizes = [-(-a.nbytes // _ALIGN) * _ALIGN for a in arrays]
        if self._used + sum(sizes) > self._current.host.numel():
            # Grow both slots. Tensors already handed out for this step keep the old slot's memory alive,
            # and the device is idle after the synchronisation in _allocate, so nothing is overwritten.
            self._allocate(max(2 * self._current.host.numel(), sum(sizes) + _ALIGN))
            self._current, self._used = self.slots[self._next ^ 1], 0
        slot, start = self._current, self._used
        offsets = np.cumsum([start] + sizes[:-1]).tolist()
        host = slot.host.numpy()
        for a, off in zip(arrays, offsets):
            host[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        end = start + sum(sizes)
        with torch.cuda.stream(self.h2d_stream):
            slot.device[start:end].copy_(slot.host[start:end], non_blocking=True)
            slot.copied.record()
        self.compute_stream.wait_event(slot.copied)
        self._used = end
        return [slot.device[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
                for a, off in zip(arrays, offsets)]

    def begin_step(self) -> None:
        """Take the next slot (A, B, A, ...) for the step being prepared."""
        if self.h2d_stream is None:
            return
        slot = self.slots[self._next]
        self._next ^= 1
        slot.copied.synchronize()  # its pinned bytes were read two steps ago: normally no wait
        self.h2d_stream.wait_event(slot.consumed)  # device-side: the step that read this slot has run
        self._current, self._used = slot, 0

    def end_step(self) -> None:
        """Call once the step's last use of its staged tensors is queued on the compute stream."""
        if self.h2d_stream is None:
            return
        self._current.consumed.record(self.compute_stream)
        self._current = None


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.uint8): torch.uint8}

"""StepStaging: pinned A/B slots on an H2D stream (GPU), zero-copy wrapping on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen.runner.staging import StepStaging


def test_staging_on_cpu_wraps_host_arrays_without_copying():
    staging = StepStaging(torch.device("cpu"), None)
    staging.begin_step()
    a = np.arange(5, dtype=np.int64)
    (t,) = staging.to_device([a])
    staging.end_step()
    t[0] = 42
    assert a[0] == 42


@pytest.mark.gpu
def test_staged_tensors_hold_their_values_across_slot_reuse_and_growth():
    compute = torch.cuda.Stream()
    staging = StepStaging(torch.device("cuda"), compute, capacity_bytes=256)
    rng = np.random.default_rng(0)
    kept = []
    with torch.cuda.stream(compute):
        for step in range(6):
            staging.begin_step()
            arrays = [rng.integers(0, 1 << 40, size=7, dtype=np.int64),
                      rng.integers(0, 1 << 20, size=(3, 5), dtype=np.int32),
                      rng.random(4, dtype=np.float32)]
            if step == 3:  # larger than both slots: they grow mid-step, earlier tensors stay valid
                arrays.append(rng.integers(0, 100, size=4096, dtype=np.int64))
            tensors = staging.to_device(arrays[:2]) + staging.to_device(arrays[2:])
            sums = [t.double().sum() for t in tensors]  # queued on the compute stream, like a step's use
            staging.end_step()
            kept.append((arrays, tensors, sums))
    torch.cuda.synchronize()
    for arrays, tensors, sums in kept[-2:]:  # the two latest steps still own their slots' contents
        for a, t in zip(arrays, tensors):
            assert t.dtype == torch.from_numpy(a).dtype and np.array_equal(t.cpu().numpy(), a)
    for arrays, _, sums in kept:  # every step saw its own values when it ran
        for a, s in zip(arrays, sums):
            assert float(s) == pytest.approx(float(a.astype(np.float64).sum()))

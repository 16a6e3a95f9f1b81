"""numerics.json: the device and software a deterministic output was begun on, and the warning a resume gets
when it runs elsewhere.

engine.deterministic makes a row's tokens independent of the batch, not of the machine: another GPU model (or
SM count), another CPU ISA or thread count, or another torch / CUDA / Triton build may pick other kernels and
round differently (README, "Reproducible datasets"). The fingerprint cannot hold this (it is decided before any
device is touched, and `batchgen validate` runs on machines without the job's GPU), so the first run of a
deterministic output writes what it ran on here, and every later run or worker that runs on something else
warns, naming each difference: rows it generates may differ bitwise from those an uninterrupted run on the first
stack would give. A warning, not a refusal: the rows stay exactly once and valid, and moving a long job to
another node of the same kind (same stack: no warning) is the common case. An output begun before this file
existed records the first run that writes it.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from batchgen.output.temp_file import removed_on_failure

FILE = "numerics.json"


def numerics_stack(device, version: str) -> dict[str, str]:
    """What decides a deterministic run's bits besides the job: the device kind and the kernels' software (the
    GPU driver is not recorded: torch does not report it)."""
    import torch

    stack = {"batchgen": version, "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        stack["device"] = f"{props.name}, {props.multi_processor_count} SMs"
        stack["cuda"] = str(torch.version.cuda)
        try:
            import triton

            stack["triton"] = triton.__version__
        except ImportError:  # pragma: no cover - CUDA installs ship Triton
            stack["triton"] = "none"
    else:  # MKL / oneDNN pick code paths by ISA and split work by thread count
        stack["device"] = f"{device.type}: {platform.machine()}, {torch.backends.cpu.get_cpu_capability()}"
        stack["cpu_threads"] = str(torch.get_num_threads())
    return stack


def record_or_compare(out_dir: Path, stack: dict[str, str]) -> str | None:
    """First run: write `stack` to out_dir/numerics.json, whole or not at all (a temporary file hard-linked into
    place: among workers starting together the first link wins, and no reader sees a partial file). Later: the
    warning for a stack that differs from the recorded one, or for a record that cannot be read (None: the same
    stack, or just recorded)."""
    path = out_dir / FILE
    if not path.exists():
        with removed_on_failure(out_dir / f".{FILE}.{os.getpid()}.tmp", path) as tmp:
            with open(tmp, "w") as f:
                json.dump(stack, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
                return None
            except FileExistsError:  # another worker recorded its stack first: compare with it
                pass
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        recorded = None
    if not isinstance(recorded, dict):
        return (f"batchgen: warning: engine.deterministic: {path} cannot be read, so this run cannot tell whether "
                f"it runs on the device and software the output was begun on (rows stay exactly once; their bits "
                f"may differ from an uninterrupted run's)")
    changes = [f"{k}: {recorded.get(k, '(none)')!r} -> {stack.get(k, '(none)')!r}"
               for k in sorted(set(recorded) | set(stack)) if recorded.get(k) != stack.get(k)]
    if not changes:
        return None
    return ("batchgen: warning: engine.deterministic: this output was begun on another device or software stack ("
            + "; ".join(changes) + f", recorded in {path}): the rows generated from now on may differ bitwise from "
            "those an uninterrupted run there would give (exactly once still holds)")

"""Hopper compile mode for the interpreter scripts (conftest.run_under_interpreter): every Triton kernel launch is
first compiled for an H100 / H200 (sm_90, through ptxas, as on the GPU: no GPU needed), then run by Triton's
interpreter as before; a build needing more shared memory than an sm_90 block has is refused, as the GPU refuses it
when loading. Why: the interpreter accepts code that the GPU compiler refuses (2026-12-02: a jit
helper's `CACHE: tl.constexpr = ""` default passed every CPU test and broke every split decode launch on the
GPU: "'str' object has no attribute 'type'"), so a CPU-only change could land with the GPU path broken.

Used in a fresh interpreter with TRITON_INTERPRET unset (triton.jit then makes JITFunctions, which can be
compiled): `install()` before batchgen's kernels run. It replaces Triton's active driver with one that names an
sm_90 target and no device, makes JITFunction.run compile (warmup: build, never launch) and then interpret the
launch, and makes a jit helper called from interpreted code run interpreted. `compiled()` lists what was built.
Compiled binaries land in Triton's cache (TRITON_CACHE_DIR): a second run of the same kernels only reads them.
"""

from __future__ import annotations

import collections

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.errors import OutOfResources
from triton.runtime.interpreter import InterpretedFunction, _patch_lang  # triton==3.6.0 (pyproject pins it)
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200: the GPUs batchgen's kernels are tuned and tested on
SM90_MAX_SHARED_BYTES = 232_448  # a block's shared memory on an H100 / H200 (227 KiB): Triton refuses more at load
_BUILT: collections.Counter = collections.Counter()


class HopperCompileOnly:
    """Triton's driver interface, as much of it as JITFunction.run's compile path asks: an sm_90 target, device 0,
    no stream. Loading or launching a kernel is never asked (warmup)."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def install() -> None:
    interpreted: dict = {}

    def as_interpreted(fn) -> InterpretedFunction:
        if fn not in interpreted:
            interpreted[fn] = InterpretedFunction(fn)
        return interpreted[fn]

    compile_for_hopper, call_compiled = JITFunction.run, JITFunction.__call__
    interpreting = [False]  # the compiler calls jit helpers too (with IR values): only the interpreter's calls divert

    def run(self, *args, grid, warmup, **kwargs):
        # the GPU compiler's view first (its errors name the kernel and line), then the interpreter's result
        kernel = compile_for_hopper(self, *args, grid=grid, warmup=True, **kwargs)
        _BUILT[self.fn.__name__] += 1
        if kernel.metadata.shared > SM90_MAX_SHARED_BYTES:  # the GPU's load-time check, which warmup never reaches
            raise OutOfResources(kernel.metadata.shared, SM90_MAX_SHARED_BYTES, f"shared memory ({self.fn.__name__})")
        if warmup:
            return None
        interpreting[0] = True
        try:
            return as_interpreted(self.fn).run(*args, grid=grid, warmup=False, **kwargs)
        finally:
            interpreting[0] = False

    def call(self, *args, **kwargs):  # a jit helper called from an interpreted kernel, or from the compiler
        if not interpreting[0]:
            return call_compiled(self, *args, **kwargs)
        # as InterpretedFunction.__call__, but its patches of triton.language undone on return: left in place
        # (harmless under TRITON_INTERPRET=1) they would reach the next kernel's GPU compile
        scope = _patch_lang(self.fn)
        try:
            return as_interpreted(self.fn).rewrite()(*args, **kwargs)
        finally:
            scope.restore()

    driver.set_active(HopperCompileOnly())
    JITFunction.run = run
    JITFunction.__call__ = call


def compiled() -> dict[str, int]:
    """Kernel name -> launches compiled for sm_90 so far (a launch whose build was cached counts too)."""
    return dict(_BUILT)

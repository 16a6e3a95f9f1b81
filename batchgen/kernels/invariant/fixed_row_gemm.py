"""cuBLAS at a fixed row count: the fast batch-invariant GEMM of `engine.deterministic` on CUDA.

Why it is invariant: cuBLAS picks its kernel (tile shape, split-K, reduction scheme) from the problem (M, N, K),
the dtypes, the leading dimensions, the operands' address alignment, its workspace and the library, and for a
fixed choice it is bitwise reproducible (NVIDIA's cuBLAS guide, "Results reproducibility": the same toolkit on
GPUs of the same architecture and SM count, with one workspace per stream, which torch gives every stream). In
an MMA GEMM, output row i is row i of x against the weight's columns, summed in the kernel's fixed order: it
does not read the other rows. So if every call has the same M, every row is summed the same way whatever the
batch. `fixed_row_linear` makes every call exactly FIXED_ROWS rows:

  - M < FIXED_ROWS: x is copied into a fresh zeroed [FIXED_ROWS, K] buffer, the GEMM runs, the M rows are copied
    out (into a fresh [M, N]: a view of the padded output would keep a [256, V] logits tensor alive per graph);
  - M == FIXED_ROWS, x contiguous and aligned: one call on x itself, no copies;
  - M > FIXED_ROWS: FIXED_ROWS-row chunks (views of x: a chunk of a contiguous x starts FIXED_ROWS * K elements
    further, so it keeps x's alignment), the last one padded as above, each output chunk copied into [M, N].

Every call's A operand is thus a contiguous [FIXED_ROWS, K] tensor at an address aligned to ALIGN_BYTES (torch's
CUDA allocator gives 512-byte aligned blocks; torch tells cuBLASLt the operands' alignment, up to 256 bytes), its
output a fresh allocation, its weight and bias the layer's own: one kernel per weight, always.

Why 256: the job workload (256 sequences, max_num_seqs 256) decodes 256 rows a step, so its decode
GEMMs are one call each, the same cuBLASLt GEMM the default mode's 256-row graph runs, with no padding and no
copies (the GEMMs were ~6 ms of the default's ~10 ms step on an H200). Smaller batches pay the padding: a step
of M rows costs the 256-row GEMM plus a zero-fill, a copy in and a copy out per GEMM. W1 (32 sequences) is the
worst case: the 8B model's decode GEMMs take ~4.4 ms a step at 32 rows in the default mode (weight-read bound),
here the ~6 ms of 256 rows plus ~3 small kernels x 129 GEMMs (~0.5-1 ms), predicted ~1.5x the default's GEMM
time at W1 (not measured: bench/invariant_gemm.py times both). Prefill and mixed steps pay at most 255 padded
rows per GEMM (a mixed step of 255 decodes and a 300-token chunk runs 3 calls where the default runs one of 555
rows; an 8,192-token prefill step pads nothing). A smaller FIXED_ROWS would split the job's decode into several
calls, each reading the whole weight again; a larger one would double its decode GEMMs.

The library is pinned (BLAS_LIBRARY) around every call, eager prefill and decode-graph capture alike: torch's
choice is process-global, so it is set for the call and restored after (`preferred_blas`). engine.config refuses
`graph_blas_library` values that would contradict it.

Hazards: that a vendor kernel's rows are independent is an assumption, checked per weight on the device at build
time (kernels/invariant/linear.py, which falls back to the Triton GEMM for a weight that fails). The bits hold
for one GPU kind (architecture and SM count: a MIG slice or a GPU with another SM count may pick other kernels)
and one torch/cuBLAS build; torch's matmul flags (allow_tf32, allow_bf16_reduced_precision_reduction) must stay
as they are in the process. Two GPUs of the same kind with the same software agree.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

FIXED_ROWS = 256  # rows of every cuBLAS call (see the module docstring for why 256)
ALIGN_BYTES = 256  # an A operand at an address not aligned to this is copied into a fresh buffer first
BLAS_LIBRARY = "cublaslt"  # the default mode's decode graphs' library (engine.graph_blas_library's default)


@contextlib.contextmanager
def preferred_blas(library: str | None):
    """torch's BLAS back end set to `library` ('cublas' or 'cublaslt') inside the block, restored after; None:
    unchanged. Process-global in torch: hazard for other threads running GEMMs meanwhile (the engine runs one)."""
    if library is None:
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def _is_fixed_operand(chunk: torch.Tensor) -> bool:
    """Whether a [FIXED_ROWS, K] slice can be the GEMM's A operand as it is: contiguous and aligned."""
    return chunk.is_contiguous() and chunk.data_ptr() % ALIGN_BYTES == 0


def _padded(chunk: torch.Tensor, rows: int) -> torch.Tensor:
    """A fresh contiguous [rows, K] copy of chunk [m, K] (m <= rows), zeros below it."""
    buf = chunk.new_zeros(rows, chunk.shape[1])
    buf[:chunk.shape[0]] = chunk
    return buf


def fixed_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gemm=F.linear,
                     rows: int = FIXED_ROWS) -> torch.Tensor:
    """y = gemm(x, weight, bias) with every call of `gemm` on exactly `rows` rows. x: [M, K]; weight: [N, K];
    returns [M, N] in x's dtype. Row i of y is row i of some call's output: if `gemm`'s rows are independent at
    `rows` rows, y's are at every M. `gemm` is F.linear's signature (tests pass stand-ins)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    num_rows = x.shape[0]
    if num_rows == rows and _is_fixed_operand(x):
        return gemm(x, weight, bias)
    out = torch.empty(num_rows, weight.shape[0], dtype=x.dtype, device=x.device)
    for lo in range(0, num_rows, rows):
        chunk = x[lo:lo + rows]
        m = chunk.shape[0]
        operand = chunk if m == rows and _is_fixed_operand(chunk) else _padded(chunk, rows)
        out[lo:lo + m] = gemm(operand, weight, bias)[:m]
    return out


def cublas_fixed_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear on BLAS_LIBRARY, FIXED_ROWS rows a call (CUDA tensors). x: [M, K] -> [M, N]."""
    with preferred_blas(BLAS_LIBRARY):
        return fixed_row_linear(x, weight, bias)

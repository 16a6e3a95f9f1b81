"""Weight layout for the fused decoders: projections that read the same input (q/k/v, gate/up) as one GEMM.

The fused weights are the model's own memory: the Linear weights are rebound as views into one concatenated
tensor, so transformers' forward (prefill and mixed steps) keeps working on the same bytes and no weight is
held twice. (Tensor-parallel sharding of these weights will live here too.)
"""

from __future__ import annotations

import torch


def fuse_linears(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the Linears' weights (and biases) along the output dim; rebind each as a view into it.
    Idempotent: weights already laid out back to back in one tensor are reused, not copied again."""
    weights = [lin.weight for lin in linears]
    fused = _adjacent(weights)
    if fused is None:
        fused = torch.cat([w.detach() for w in weights])
        _rebind(linears, "weight", fused)
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return fused, None
    if any(b is None for b in biases):
        raise ValueError("cannot fuse projections where only some have a bias")
    fused_bias = _adjacent(biases)
    if fused_bias is None:
        fused_bias = torch.cat([b.detach() for b in biases])
        _rebind(linears, "bias", fused_bias)
    return fused, fused_bias


def _adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The single tensor these are consecutive row slices of, if they are; else None."""
    first = tensors[0]
    ptr, size = first.data_ptr(), first.element_size()
    for t in tensors:
        if t.data_ptr() != ptr or not t.is_contiguous() or t.untyped_storage().data_ptr() != \
                first.untyped_storage().data_ptr():
            return None
        ptr += t.numel() * size
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                            (rows, *first.shape[1:]))


def _rebind(linears: list[torch.nn.Linear], name: str, fused: torch.Tensor) -> None:
    start = 0
    for lin in linears:
        param = getattr(lin, name)
        rows = param.shape[0]
        param.data = fused[start:start + rows]
        start += rows

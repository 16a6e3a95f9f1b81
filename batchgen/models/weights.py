"""Weight layout for the fused decoders: projections that read the same input (q/k/v, gate/up) as one GEMM, and
the LM head padded to an aligned row count (`PaddedHead`).

The fused weights are the model's own memory: the Linear weights are rebound as views into one concatenated
tensor, so transformers' forward (prefill and mixed steps) keeps working on the same bytes and no weight is
held twice. A tensor-parallel rank's shard of these weights: models/shard.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.quant.linear import LinearWeight, fused_weight, mixed_reason


def fuse_linears(linears: list[torch.nn.Module]) -> tuple[LinearWeight, torch.Tensor | None]:
    """Concatenate the Linears' weights (and biases) along the output dim; rebind each as a view into it.
    Idempotent: weights already laid out back to back in one tensor are reused, not copied again. Quantised
    projections (all or none of `linears`) give a quantised weight over the fused one, with their scales joined
    (quant/linear.py fused_weight)."""
    reason = mixed_reason([linears])
    if reason is not None:
        raise ValueError(reason)
    weights = [lin.weight for lin in linears]
    fused = _adjacent(weights)
    if fused is None:
        fused = torch.cat([w.detach() for w in weights])
        _rebind(linears, "weight", fused)
    fused = fused_weight(linears, fused)
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


# The LM head's rows (the logits' row stride) padded to a multiple of this: over a vocabulary such as Granite's
# 49,155 the [B, V] logits' odd row stride leaves cuBLAS only its unaligned kernels (measured on the H200: an sm75
# `align1` CUTLASS kernel, 468 µs a step at 32 rows for 403 MB of weight, 0.86 TB/s; the aligned heads run at ~4)
HEAD_ROW_MULTIPLE = 64


class PaddedHead:
    """The LM head with its vocabulary rows zero-padded to a multiple of HEAD_ROW_MULTIPLE for the GEMM, the
    logits trimmed back to [B, V] (contiguous). The module's weight (and a tied embedding, the same Parameter) is
    rebound as a view of the padded tensor's first V rows: no byte is held twice. Building it holds the old and
    the padded weight at once for a moment (V x E elements more, before the old is freed)."""

    def __init__(self, head: torch.nn.Linear) -> None:
        vocab = head.weight.shape[0]
        rows = -(-vocab // HEAD_ROW_MULTIPLE) * HEAD_ROW_MULTIPLE
        self.vocab_size = vocab
        for name in ("weight", "bias"):
            t = getattr(head, name)
            padded = None
            if t is not None:
                padded = _padded_storage(t, rows)  # a second engine on the same model: the first one's
                if padded is None:
                    padded = t.detach().new_zeros((rows, *t.shape[1:]))  # padding rows: zero logits, trimmed
                    padded[:vocab] = t.detach()
                    t.data = padded[:vocab]
            setattr(self, name, padded)  # weight [V_pad, E]; bias [V_pad] or None

    @staticmethod
    def wanted(head: torch.nn.Module) -> bool:
        """Whether `head` is a plain float Linear whose vocabulary is not a multiple of HEAD_ROW_MULTIPLE."""
        w = getattr(head, "weight", None)
        return type(head) is torch.nn.Linear and isinstance(w, torch.Tensor) and w.dim() == 2 \
            and w.is_floating_point() and w.element_size() > 1 and w.shape[0] % HEAD_ROW_MULTIPLE != 0

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight, self.bias)[:, :self.vocab_size].contiguous()  # [S, V]


def _padded_storage(t: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The [rows, ...] tensor `t` is the leading rows of, when an earlier PaddedHead made it so (t starts its
    storage, which holds `rows` rows exactly); else None."""
    row_bytes = t[0].numel() * t.element_size()
    if t.storage_offset() != 0 or not t.is_contiguous() or t.untyped_storage().nbytes() != rows * row_bytes:
        return None
    return t.detach().new_empty(0).set_(t.untyped_storage(), 0, (rows, *t.shape[1:]))

"""Token bitmasks on the logits (structured output): masked tokens become -inf before the sampler's
penalties, temperature and filters. The bitmasks come from sample/grammar.py (xgrammar's layout: int32 words,
bit t % 32 of word t // 32 set = token t allowed).

Out of place: the logits the forward returned stay raw, because the log-probs are computed from them after the
draw (sample/logprobs.py), and a CUDA graph's logits buffer must not be written. On CUDA xgrammar's kernel
does the masking (in place on our fp32 copy); on CPU, or if that kernel cannot run, torch ops do.
"""

from __future__ import annotations

import torch

_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}  # [32] int32 0..31 per device
_xgrammar_kernel_ok = True  # cleared after xgrammar's CUDA kernel failed once (then torch ops everywhere)


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a bitmask over `vocab_size` tokens: ceil(V / 32)."""
    return -(-vocab_size // 32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [G, W] int32 -> [G, V] bool, True where the token is allowed."""
    shifts = _BIT_SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [G, W, 32]: arithmetic shift, the & keeps bit 0 only
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _mask_inplace(x: torch.Tensor, bitmask: torch.Tensor) -> None:
    """x [G, V] fp32 (a copy we own), bitmask [G, W] int32 on x's device."""
    global _xgrammar_kernel_ok
    if x.is_cuda and _xgrammar_kernel_ok:
        try:
            import xgrammar

            xgrammar.apply_token_bitmask_inplace(x, bitmask, vocab_size=x.shape[1])
            return
        except Exception:  # no Triton / an unsupported GPU: the torch path below is exact, only slower
            _xgrammar_kernel_ok = False
    x.masked_fill_(~allowed_tokens(bitmask, x.shape[1]), float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, V] (any float dtype), rows [G] int64 (the constrained rows, in bitmask order; None: every row,
    G == S), bitmask [G, W] int32 on the logits' device -> new fp32 [S, V] logits with the masked tokens -inf.
    Hazard: a row whose mask allows nothing is all -inf (the draw is then arbitrary); a grammar always allows
    a token or has terminated (then its mask is all ones)."""
    x = logits.float()
    if x.data_ptr() == logits.data_ptr():  # already fp32: `.float()` returned the raw logits themselves
        x = x.clone()
    if rows is None:
        _mask_inplace(x, bitmask)
        return x
    sub = x.index_select(0, rows)  # [G, V] a copy
    _mask_inplace(sub, bitmask)
    return x.index_copy_(0, rows, sub)

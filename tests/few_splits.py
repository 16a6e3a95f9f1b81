"""Decode attention launches capped at a few KV splits, for the interpreter scripts that run whole decoder steps
(tests/models/test_fused_decoder.py, tests/quant/test_fp8_fusion_steps.py).

The launch table gives their 4-row decode batches 16-32 splits (on a GPU that fills the SMs), while their sequences
hold at most 17 tokens, one 64-key tile: every split but the first has no keys. Triton's interpreter runs a grid's
programs one after another in Python, so those empty programs (about 50 ms each) were most of the scripts' time:
over 100 of the 130 s of Llama's FP8 steps on 2 cores (cProfile, 2026-12-06). With `install()` the launch keeps
the table's tile, warps, MMA and grid order and takes at most MAX_SPLITS splits, so the steps still run the split
kernel and its merge. The split counts themselves (1, 2 and 4, empty splits, the new token in each split) are
checked against the reference in tests/kernels/test_kernels.py.
"""

from __future__ import annotations

import dataclasses

MAX_SPLITS = 2


def install() -> None:
    """Cap the launches of paged_decode's callers that leave the choice to the table (an explicit launch or split
    count is left as it is)."""
    from batchgen.kernels.attention import paged_decode

    table_launch = paged_decode.default_launch

    def capped(num_seqs, num_kv_heads, head_dim, num_splits=None, group=None, kv_element_bytes=2):
        launch = table_launch(num_seqs, num_kv_heads, head_dim, num_splits, group, kv_element_bytes)
        if num_splits is None and launch.num_splits > MAX_SPLITS:
            launch = dataclasses.replace(launch, num_splits=MAX_SPLITS)
        return launch

    paged_decode.default_launch = capped

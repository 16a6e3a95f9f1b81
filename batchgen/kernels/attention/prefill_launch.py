"""How the paged prefill attention kernel (kernels/attention/paged_prefill.py) is cut and launched for a step, on the host.

`prefill_launch` is the one place that picks a launch from the step's shape; `prefill_work` cuts the step's
queries into work items of that launch's block_m tokens; `PrefillWork` carries the two together from the runner to
the kernel (through the attention metadata), so the kernel never tiles a work list with another block_m.
Invariant: a launch changes the kernel's speed and the order of its fp32 additions, never which keys a query sees.
No Triton here: the runner imports this on every install.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

BLOCK_M_CHOICES = (16, 32, 64, 128)
BLOCK_N_CHOICES = (16, 32, 64, 128)
NUM_WARPS_CHOICES = (4, 8)
NUM_STAGES_CHOICES = (2, 3, 4)


@dataclass(frozen=True)
class PrefillLaunch:
    """Query tokens a work item (a program's tile holds block_m tokens x the query heads sharing its KV head),
    keys a K/V tile, and Triton's warps and software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name, choices in (("block_m", BLOCK_M_CHOICES), ("block_n", BLOCK_N_CHOICES),
                              ("num_warps", NUM_WARPS_CHOICES), ("num_stages", NUM_STAGES_CHOICES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"PrefillLaunch.{name} is {getattr(self, name)}, not one of {choices}")


# Measured on the H200 (bench/prefill_attention_sweep.py, Llama-8B heads, 2026-12-02,
# bench/results/2026-12-02-prefill-kernels-fp8-job.md; ms over 32 layers):
# - steps whose longest query is shorter than LONG_PROMPT (a job's refills, decode-heavy mixed steps): 16 tokens an
#   item on 32-key tiles, 8,192 tokens of 68-token prompts 2.62 ms against 3.58 with 64-key tiles (the launch
#   before the sweep) and 3.28-4.66 for every larger item;
# - a step with a long prompt: 64 tokens an item (256 rows: 64 tokens x 4 query heads), 64-key tiles, 8 warps,
#   3 stages: 8,192 tokens of 2,048-token prompts 13.15 ms against 14.23, 512-token chunks after 1,536 cached
#   5.84 against 6.63; a lone 2,048-token prompt 4.81 against 4.40 (too few items to fill the GPU: accepted).
SHORT_PROMPT_LAUNCH = PrefillLaunch(block_m=16, block_n=32, num_warps=4, num_stages=2)
LONG_PROMPT = 512  # the longest query, in tokens, from which a step takes LONG_PROMPT_LAUNCH
LONG_PROMPT_LAUNCH = PrefillLaunch(block_m=64, block_n=64, num_warps=8, num_stages=3)
# The long launch's tiles fit a Hopper SM's shared memory (227 KiB a block) only for query rows of at most this
# many bytes (its head dim padded to a power of two x the activations' element size): Llama's 128 dims in bf16
# take 131,328 bytes; 256 dims in bf16 (Gemma's) or 128 in fp32 take 262,400 (sm_90 compiles,
# 2026-12-02), a launch Triton refuses. Wider rows keep the short launch (98,304 bytes at 128 x bf16).
LONG_LAUNCH_MAX_ROW_BYTES = 256


def prefill_launch(max_query_len: int, head_dim: int = 128, element_bytes: int = 2) -> PrefillLaunch:
    """The launch for a step whose longest query (new tokens of one sequence) is max_query_len tokens, for query
    heads of head_dim values of element_bytes each (the activations' dtype)."""
    row_bytes = (1 << max(0, head_dim - 1).bit_length()) * element_bytes
    if max_query_len >= LONG_PROMPT and row_bytes <= LONG_LAUNCH_MAX_ROW_BYTES:
        return LONG_PROMPT_LAUNCH
    return SHORT_PROMPT_LAUNCH


def prefill_work(q_lens: np.ndarray, query_start_loc: np.ndarray, block_m: int) -> np.ndarray:
    """[P, 2] int32 work items (sequence index, packed index of the item's first token), in sequence order:
    ceil(q_len / block_m) items per sequence, each of block_m tokens but a sequence's last.
    q_lens: [S]; query_start_loc: [S + 1]."""
    counts = (q_lens + block_m - 1) // block_m
    seq = np.repeat(np.arange(len(q_lens)), counts)
    first_item = np.cumsum(counts) - counts
    offset = np.arange(len(seq)) - np.repeat(first_item, counts)
    return np.stack([seq, query_start_loc[:-1][seq] + block_m * offset], axis=1).astype(np.int32)


@dataclass(frozen=True)
class PrefillWork:
    """A work list and the launch it was cut for: `items` come from prefill_work(..., launch.block_m)."""

    items: torch.Tensor  # [P, 2] int32, on the queries' device
    launch: PrefillLaunch

    @staticmethod
    def build(q_lens: np.ndarray, query_start_loc: np.ndarray, launch: PrefillLaunch | None = None,
              device: torch.device | str = "cpu") -> PrefillWork:
        """The step's work list on `device`, for `launch` (None: prefill_launch of the longest query, Llama's
        128-dim bf16 heads)."""
        launch = launch or prefill_launch(int(np.max(q_lens)))
        items = torch.from_numpy(prefill_work(q_lens, query_start_loc, launch.block_m)).to(device)
        return PrefillWork(items, launch)

    def after(self, num_items: int) -> PrefillWork:
        """The list less its first num_items items (a mixed step's decode rows: one item each, packed first)."""
        return replace(self, items=self.items[num_items:])

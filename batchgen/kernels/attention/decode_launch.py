"""Which launch the paged decode attention kernels (kernels/attention/paged_decode.py) use for a batch's shape.

`default_launch` looks the shape up in a table of launches measured on the GPU (decode_launches.json beside this
file, written by `bench/decode_attention_sweep.py --write-table`) and, for a head geometry the table does not hold,
falls back to a heuristic tuned on Llama's 8 KV heads x 128. Invariant: the launch is a pure function of its
arguments and the shipped file (the file is read once a process), so a shape always gets the same launch: a CUDA
graph captured for a bucket stays valid, and the order of the fp32 additions is fixed by the shape alone.

The table's entries carry the device they were measured on; they are used on any device (they are all H200
measurements today: a table for another GPU would need the device in the look-up key). The heuristic's
large-batch rule (LARGE_BATCH_PROGRAMS) was measured on an H100. Under the Triton interpreter (CPU) the
launch changes nothing but speed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from pathlib import Path

from batchgen.kernels.launch_tables import check_keys, read_entries

TABLE_PATH = Path(__file__).with_name("decode_launches.json")
MAX_SPLITS = 32  # the most context splits a (sequence, KV head) gets: the heuristic's cap and the table's


@dataclass(frozen=True)
class DecodeLaunch:
    """How a decode attention launch spreads its work: context splits per (sequence, KV head), keys a tile, and
    Triton's warps and pipeline stages (None: Triton's default). Changes timing and the order of the fp32
    additions, never which keys a query sees."""

    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int | None = None
    # tl.dot over the query group padded to 16 rows (tensor cores), or, False, the group's own rows on CUDA cores
    # (for MHA models' single query a KV head, 15 of 16 padded rows are waste)
    mma: bool = True
    # the grid's order: (sequences, KV heads, splits), or, True, (KV heads, sequences, splits)
    heads_first: bool = False


@dataclass(frozen=True)
class TableEntry:
    """One measured shape: the fastest launch for (head_dim, num_kv_heads, group) at num_seqs x context."""

    head_dim: int
    num_kv_heads: int
    group: int  # query heads per KV head
    num_seqs: int
    context: int
    launch: DecodeLaunch
    us: float  # the launch's time
    default_us: float  # the heuristic launch's time in the same run
    device: str  # torch.cuda.get_device_name() of the measuring GPU


def default_num_splits(num_seqs: int, num_kv_heads: int, target_programs: int = 256) -> int:
    """Context splits per (sequence, KV head): enough programs to keep every SM streaming (~2 per SM on
    an H200's 132 SMs), no more, since each split writes partials the merge must read back (and one split
    lets the kernel write the output directly). A function of the batch's shape alone (never of the sequences'
    lengths), so a launch captured in a CUDA graph stays valid for every step of its bucket."""
    splits = 1
    while splits < MAX_SPLITS and num_seqs * num_kv_heads * splits < target_programs:
        splits *= 2
    return splits


# The head size the heuristic's launches were measured at (Llama's 128). Wider heads take proportionally fewer keys
# a tile, so that a tile holds as many elements per warp as the measured launch, or registers spill: Gemma2's
# 256-dim heads at Llama's block_n 128 ran at 2.05x their K/V bytes on the H200 (2026-12-01,
# bench/results/2026-12-01-logprobs-moe-deterministic-cost.md).
MEASURED_HEAD_DIM = 128

# From this many (sequence, KV head) programs (512 Llama-8B sequences), one split's tile is 64 keys / 4 warps / 2
# stages with the grid KV-heads first. On the H100 (2026-12-05, bench/results/2026-12-05-decode-attention-large-
# batch-h100.md) it took 260.9 us against 280.0 for 128 / 4 / 3 stages over 1,024 ragged 32-320-token sequences
# (137.1 against 143.8 at 512), was no slower where a few sequences are long (1,024 ragged 32-3,072: 2,092 against
# 2,112 us), and the job at 1,024 sequences ran its decode steps 1.3 % faster. Below it (256 sequences) the two
# tiles tie on long ragged batches and the H200's measurements chose 128 / 4.
LARGE_BATCH_PROGRAMS = 4096
# An fp8 K/V cache (one byte a value) takes 2 warps at that tile: on the H100 (2026-12-05, bench/results/2026-12-05-
# idle-trace-fp8-large-batch-h100.md) 205.4 us against 256.6 for 4 warps over 1,024 ragged 32-320-token sequences,
# and 108.5 against 142.6 at 512 (the fastest of the 43 launches swept there, or within 1 % of it).
LARGE_BATCH_FP8_WARPS = 2


def heuristic_launch(num_seqs: int, num_kv_heads: int, head_dim: int, num_splits: int | None = None,
                     kv_element_bytes: int = 2) -> DecodeLaunch:
    """The launch bench/profile_decode.py and bench/decode_attention_sweep.py measured best (on the H200; the
    large-batch rule on the H100), on Llama's heads: the geometries without a table entry are Llama-like today
    (8 KV heads of 128, group 4; Qwen3-30B-A3B's 4 of 128, group 8).
    Llama-8B heads (8 x 128): 32 seqs x 768 context (256 programs): 1 split at block_n 128 / 4 warps, 2 splits at 64 /
    2 warps. 256 seqs (2,048 programs): 1 split at 128 / 4. Where every sequence has the same context, block_n 32 / 2
    warps / 2 stages is within 5 % of the fastest launch at every context (at 160 tokens 53 µs against 64 for 128 /
    4), but a long run's batches are ragged, and there the short tiles lose: lengths 32-3,072 took 462 µs against
    396-404 for 128 / 4 / 3 stages, and on the mixed load they cost 13 % more decode attention kernel time
    (2026-12-02, bench/results/2026-12-02-mixed-regression-decode-launch.md: the few long sequences left at the end of
    a launch stream too slowly through 32-key tiles). From LARGE_BATCH_PROGRAMS programs, one split's tile is 64
    keys / 4 warps / 2 stages, KV heads first (see there; 2 warps over an fp8 cache, `kv_element_bytes` 1). Wider
    heads: the same launch with block_n scaled by MEASURED_HEAD_DIM / padded head dim. `num_splits`: the caller's
    (None: default_num_splits)."""
    num_splits = num_splits or default_num_splits(num_seqs, num_kv_heads)
    padded = 1 << (head_dim - 1).bit_length()  # triton.next_power_of_2 (head_dim >= 1)
    narrow = max(1, padded // MEASURED_HEAD_DIM)  # 2 for 256-dim heads
    if num_splits == 1 and num_seqs * num_kv_heads >= LARGE_BATCH_PROGRAMS:
        return DecodeLaunch(1, max(16, 64 // narrow), LARGE_BATCH_FP8_WARPS if kv_element_bytes == 1 else 4, 2,
                            heads_first=True)
    if num_splits == 1:
        return DecodeLaunch(1, max(16, 128 // narrow), 4)
    return DecodeLaunch(num_splits, max(16, 64 // narrow), 2)


def scaled_splits(entry_splits: int, entry_seqs: int, num_seqs: int) -> int:
    """The splits that keep a measured entry's number of programs at num_seqs sequences: entry_splits *
    entry_seqs / num_seqs, rounded to the nearest power of two in log2 (exactly, in rationals), within
    [1, MAX_SPLITS]."""
    ratio = Fraction(entry_splits * entry_seqs, max(1, num_seqs))
    splits = 1
    # 2 * splits is nearer in log2 than splits when ratio >= splits * sqrt(2), i.e. ratio^2 >= 2 splits^2
    while splits < MAX_SPLITS and ratio * ratio >= 2 * splits * splits:
        splits *= 2
    return splits


def nearest_entry(entries: tuple[TableEntry, ...], num_seqs: int, num_kv_heads: int, head_dim: int,
                  group: int) -> TableEntry | None:
    """Among the entries of this (head_dim, num_kv_heads, group), the one whose num_seqs is nearest in log2
    distance (ties: the larger num_seqs); None if there is none."""
    same = [e for e in entries if (e.head_dim, e.num_kv_heads, e.group) == (head_dim, num_kv_heads, group)]
    n = max(1, num_seqs)
    # |log2(e.num_seqs / n)| compared exactly as the ratio max / min (>= 1), then the larger num_seqs first
    return min(same, key=lambda e: (Fraction(max(e.num_seqs, n), min(e.num_seqs, n)), -e.num_seqs), default=None)


def launch_from_table(entries: tuple[TableEntry, ...], num_seqs: int, num_kv_heads: int, head_dim: int,
                      num_splits: int | None = None, group: int | None = None,
                      kv_element_bytes: int = 2) -> DecodeLaunch:
    """default_launch with the table passed in (a pure function: tests give their own entries). The nearest
    entry's tile with its splits scaled to this batch (or the caller's `num_splits`); without an entry for the
    geometry, or without a `group`, the heuristic (for the cache's element size)."""
    entry = None if group is None else nearest_entry(entries, num_seqs, num_kv_heads, head_dim, group)
    if entry is None:
        return heuristic_launch(num_seqs, num_kv_heads, head_dim, num_splits, kv_element_bytes)
    splits = num_splits or scaled_splits(entry.launch.num_splits, entry.num_seqs, num_seqs)
    return replace(entry.launch, num_splits=splits)


@functools.lru_cache(maxsize=1024)  # called per layer in eager (prefill / mixed) steps: a pure function of ints
def default_launch(num_seqs: int, num_kv_heads: int, head_dim: int, num_splits: int | None = None,
                   group: int | None = None, kv_element_bytes: int = 2) -> DecodeLaunch:
    """The launch for a batch of `num_seqs` decode rows: the shipped table's (see launch_from_table), else the
    heuristic. `group`: query heads per KV head (None: the heuristic alone, for callers that do not know it);
    `num_splits`: the caller's (None: the table's scaled, or default_num_splits); `kv_element_bytes`: the K/V
    cache's (1: fp8). The table's entries were measured over bf16 caches and apply to any."""
    return launch_from_table(load_table(), num_seqs, num_kv_heads, head_dim, num_splits, group, kv_element_bytes)


@functools.lru_cache(maxsize=8)  # read once a process; the entries are immutable
def load_table(path: Path | str = TABLE_PATH) -> tuple[TableEntry, ...]:
    """The entries of a launch table file, validated (parse_table)."""
    return parse_table({"entries": list(read_entries(path))}, str(path))


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


# key -> (type check, what it must be); bool is a subclass of int, so ints are checked with `type(v) is int`
_ENTRY_KEYS = {
    "head_dim": (lambda v: type(v) is int and v >= 2 and v % 2 == 0, "an even int >= 2"),
    "num_kv_heads": (lambda v: type(v) is int and v >= 1, "an int >= 1"),
    "group": (lambda v: type(v) is int and v >= 1, "an int >= 1"),
    "num_seqs": (lambda v: type(v) is int and v >= 1, "an int >= 1"),
    "context": (lambda v: type(v) is int and v >= 1, "an int >= 1"),
    "launch": (lambda v: isinstance(v, dict), "an object of DecodeLaunch fields"),
    "us": (lambda v: type(v) in (int, float) and v > 0, "a number > 0"),
    "default_us": (lambda v: type(v) in (int, float) and v > 0, "a number > 0"),
    "device": (lambda v: isinstance(v, str), "a string"),
}
_LAUNCH_KEYS = {
    "num_splits": (lambda v: type(v) is int and _pow2(v) and v <= MAX_SPLITS, f"a power of two <= {MAX_SPLITS}"),
    "block_n": (lambda v: type(v) is int and _pow2(v) and v >= 16, "a power of two >= 16"),
    "num_warps": (lambda v: type(v) is int and _pow2(v) and v <= 32, "a power of two <= 32"),
    "num_stages": (lambda v: v is None or (type(v) is int and v >= 1), "null or an int >= 1"),
    "mma": (lambda v: isinstance(v, bool), "a bool"),
    "heads_first": (lambda v: isinstance(v, bool), "a bool"),
}
assert set(_LAUNCH_KEYS) == {f.name for f in fields(DecodeLaunch)}


def parse_table(data: object, path: str) -> tuple[TableEntry, ...]:
    """A launch table's JSON ({"about": str, "entries": [...]}) as entries. A malformed entry raises ValueError
    naming the file, the entry's index and the key; so does a second entry for the same (head_dim, num_kv_heads,
    group, num_seqs) (the look-up would be ambiguous)."""
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path}: not a launch table (an object with an 'entries' list)")
    entries, seen = [], {}
    for i, raw in enumerate(data["entries"]):
        where = f"{path}: entry {i}"
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: not an object")
        check_keys(raw, _ENTRY_KEYS, where)
        check_keys(raw["launch"], _LAUNCH_KEYS, where, "launch.")
        entry = TableEntry(**{**raw, "launch": DecodeLaunch(**raw["launch"])})
        key = (entry.head_dim, entry.num_kv_heads, entry.group, entry.num_seqs)
        if key in seen:
            raise ValueError(f"{where}: key 'num_seqs': (head_dim, num_kv_heads, group, num_seqs) {key} is also "
                             f"entry {seen[key]}'s")
        seen[key] = i
        entries.append(entry)
    return tuple(entries)

"""The chunked-head decode attention (kernels/paged_decode_chunks.py: a head dim that is not a power of two as two
power-of-two chunks, not padded) against the references, under the Triton interpreter; and where it is refused."""

import sys

import pytest
import torch

sys.path.insert(0, "tests")
from conftest import run_under_interpreter  # noqa: E402

from batchgen.kernels.paged_decode_chunks import head_chunks  # noqa: E402


def test_head_chunks_are_the_largest_power_of_two_and_the_rest_rounded_up_to_at_least_16():
    assert head_chunks(96) == (64, 32)  # Phi-3: nothing padded
    assert head_chunks(80) == (64, 16)
    assert head_chunks(24) == (16, 16)  # 8 of the hi chunk's 16 padded (tl.dot's least)
    assert head_chunks(112) == (64, 64)
    assert head_chunks(160) == (128, 32)
    assert head_chunks(128) == (128, 0) and head_chunks(64) == (64, 0)  # a power of two: nothing to split


CHUNKS_INTERPRET_SCRIPT = """
import torch, sys
sys.path.insert(0, "tests")
from test_kernels import _check, _check_rope_attention
from batchgen.kernels.paged_decode import DecodeLaunch
for splits in (1, 2, 4):  # the new token in the first, a middle and the last split; empty splits; a padding row
    for mma in (True, False):  # a group of 4 padded to 16 rows on tensor cores, or its own rows on CUDA cores
        launch = DecodeLaunch(splits, 16, 2, None, mma, chunked_head=True)
        _check_rope_attention("cpu", torch.float32, 1e-5, [1, 37, 0, 70, 16], head_dim=48, launch=launch)
    # MHA at Phi-3's head dim (64 + 32), the grid heads first; 80 (64 + 16); 24 (16 + 16, 8 padded)
    _check_rope_attention("cpu", torch.float32, 1e-5, [1, 37, 0, 70], num_heads=2, num_kv_heads=2, head_dim=96,
                          launch=DecodeLaunch(splits, 16, 2, None, True, heads_first=True, chunked_head=True))
    _check_rope_attention("cpu", torch.float32, 1e-5, [5, 19], num_heads=4, num_kv_heads=2, head_dim=80,
                          block_size=8, launch=DecodeLaunch(splits, 32, 2, chunked_head=True))
    _check_rope_attention("cpu", torch.float32, 1e-5, [5, 0, 19], num_heads=3, num_kv_heads=3, head_dim=24,
                          launch=DecodeLaunch(splits, 16, 2, None, False, chunked_head=True))
    # Gemma2/3-style options: a window shorter than the contexts and soft-capping
    _check_rope_attention("cpu", torch.float32, 1e-5, [1, 37, 0, 70, 16], head_dim=48, sliding_window=12,
                          softcap=0.5, launch=DecodeLaunch(splits, 16, 2, chunked_head=True))
    # without the rotary (paged_decode_attention: transformers' modules with our attention)
    _check("cpu", torch.float32, 1e-5, num_seqs=4, num_heads=4, num_kv_heads=2, head_dim=48, block_size=8,
           seq_lens=[70, 0, 3, 41], sliding_window=20, softcap=5.0,
           launch=DecodeLaunch(splits, 16, 2, chunked_head=True))
# a q/k norm keeps the padded kernel (same result)
_check_rope_attention("cpu", torch.float32, 1e-5, [1, 37, 70], head_dim=48, qk_norm="qwen3",
                      launch=DecodeLaunch(2, 16, 2, chunked_head=True))
print("ok")
"""


def test_chunked_head_decode_attention_matches_the_references_under_triton_interpreter():
    run_under_interpreter(CHUNKS_INTERPRET_SCRIPT)


def test_a_chunked_head_launch_is_refused_for_a_power_of_two_head_or_several_heads_a_program():
    from batchgen.kernels.paged_decode import DecodeLaunch, paged_decode_attention

    q = torch.zeros(1, 2, 64)
    cache = torch.zeros(4, 16, 2, 64)
    tables, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="chunked_head: for head dims of 16 or more that are not a power of two "
                                         "\\(here 64\\)"):
        paged_decode_attention(q, cache, cache, tables, lens, 0.1, launch=DecodeLaunch(1, 16, 2, chunked_head=True))
    q, cache = torch.zeros(1, 2, 48), torch.zeros(4, 16, 2, 48)
    with pytest.raises(ValueError, match="one KV head a program \\(here 2\\)"):
        paged_decode_attention(q, cache, cache, tables, lens, 0.1,
                               launch=DecodeLaunch(1, 16, 2, chunked_head=True, heads_per_program=2))


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens", [[769] * 32, [7, 200, 1, 0, 33, 161, 16, 1030] * 20])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("heads_first", [False, True])
def test_chunked_head_decode_attention_at_phi3_heads_bf16_on_gpu(seq_lens, splits, heads_first):
    """Phi-3-mini (32 / 32 heads of 96) with its rotary fused, bf16, on tensor cores."""
    from test_kernels import _check_rope_attention

    from batchgen.kernels.paged_decode import DecodeLaunch

    _check_rope_attention("cuda", torch.bfloat16, 2e-2, seq_lens, num_heads=32, num_kv_heads=32, head_dim=96,
                          launch=DecodeLaunch(splits, 64, 4, 2, heads_first=heads_first, chunked_head=True))


def test_the_sweep_offers_chunked_heads_where_not_a_power_of_two_and_a_fused_merge_where_split():
    from dataclasses import replace

    sys.path.insert(0, "bench")
    import decode_attention_sweep as sweep

    for grid in ("small", "full", "all"):
        plain = sweep.launches(grid, mha=True, programs=1024)
        both = sweep.launches(grid, mha=True, programs=1024, chunked=True)
        base = [x for x in plain if not x.fused_merge]
        assert [x for x in both if not x.chunked_head and not x.fused_merge] == base
        one_head = [x for x in base if x.heads_per_program == 1]
        assert [x for x in both if x.chunked_head] == [replace(x, chunked_head=True) for x in one_head]
        assert not any(x.chunked_head for x in plain)
        merged = [replace(x, fused_merge=True) for x in one_head if x.num_splits > 1]
        assert merged and [x for x in plain if x.fused_merge] == merged == [x for x in both if x.fused_merge]


FUSED_MERGE_INTERPRET_SCRIPT = """
import torch, sys
sys.path.insert(0, "tests")
from test_kernels import _check, _check_rope_attention
from batchgen.kernels import arrival
from batchgen.kernels.paged_decode import DecodeLaunch
for splits in (2, 4):  # the new token in each split; empty splits; a padding row; GQA 4 (padded to 16 rows)
    for mma in (True, False):
        for heads_first in (False, True):
            launch = DecodeLaunch(splits, 16, 2, None, mma, heads_first=heads_first, fused_merge=True)
            _check_rope_attention("cpu", torch.float32, 1e-5, [1, 37, 0, 70, 16], launch=launch)
    # a group of 7 (Qwen2-7B's), windows and soft-capping, q/k norm; then without the rotary
    _check_rope_attention("cpu", torch.float32, 1e-5, [1, 37, 0, 70], num_heads=14, num_kv_heads=2, head_dim=16,
                          sliding_window=12, softcap=0.5, qk_norm="qwen3",
                          launch=DecodeLaunch(splits, 16, 2, fused_merge=True))
    _check("cpu", torch.float32, 1e-5, num_seqs=4, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
           seq_lens=[70, 0, 3, 41], launch=DecodeLaunch(splits, 16, 2, fused_merge=True))
# every launch's last programs reset their counters: the buffer is all zeros between launches
for buf in arrival._COUNTERS.values():
    assert int(buf.abs().sum()) == 0
assert arrival._COUNTERS, "no fused-merge launch ran"
print("ok")
"""


def test_fused_merge_decode_attention_matches_the_references_and_leaves_its_counters_zero_under_interpreter():
    run_under_interpreter(FUSED_MERGE_INTERPRET_SCRIPT)


def test_fused_merge_is_refused_with_several_heads_a_program_or_chunked_heads():
    from batchgen.kernels.paged_decode import DecodeLaunch, paged_decode_attention

    q, cache = torch.zeros(1, 2, 48), torch.zeros(4, 16, 2, 48)
    tables, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="fused_merge: for one KV head a program with padded heads"):
        paged_decode_attention(q, cache, cache, tables, lens, 0.1,
                               launch=DecodeLaunch(2, 16, 2, chunked_head=True, fused_merge=True))


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens", [[769] * 32, [1, 5, 300, 4096, 8448, 17, 0, 2048]])
@pytest.mark.parametrize("splits", [2, 8])
def test_fused_merge_decode_attention_at_qwen2_heads_bf16_on_gpu(seq_lens, splits):
    """Qwen2-7B (28 / 4 heads of 128), rotary fused, the last split merging; twice, so the second launch finds the
    counters the first reset."""
    from test_kernels import _check_rope_attention

    from batchgen.kernels import arrival
    from batchgen.kernels.paged_decode import DecodeLaunch

    for _ in range(2):
        _check_rope_attention("cuda", torch.bfloat16, 2e-2, seq_lens, num_heads=28, num_kv_heads=4, head_dim=128,
                              launch=DecodeLaunch(splits, 64, 2, fused_merge=True))
    assert int(arrival._COUNTERS[torch.device("cuda", 0)].abs().sum()) == 0


@pytest.mark.gpu
def test_fused_merge_equals_the_merge_kernel_bit_for_bit_over_many_launches_and_graph_replays_on_gpu():
    """The last-split merge against the merge kernel, same launch otherwise: equal bits over many shapes (GQA and
    MHA groups, 2-16 splits, both grid orders, a window, padding rows), 50 launches each, and 100 replays of a CUDA
    graph holding 8 launches; the counters are zero after all of it. A race (a counter left non-zero, a merge
    before a split's partials landed) shows as unequal outputs."""
    from dataclasses import replace

    from test_kernels import _case

    from batchgen.kernels import arrival
    from batchgen.kernels.paged_decode import DecodeLaunch, paged_decode_attention

    dev = torch.device("cuda", 0)
    for num_heads, num_kv_heads, head_dim in ((28, 4, 128), (32, 8, 128), (16, 16, 64), (24, 2, 128)):
        for seq_lens in ([769] * 32, [1, 5, 300, 4096, 0, 17, 2048, 33] * 4):
            q, k, v, tables, lens = _case(len(seq_lens), num_heads, num_kv_heads, head_dim, 16, seq_lens,
                                          torch.bfloat16, "cuda", 0)
            for splits in (2, 4, 16):
                for heads_first in (False, True):
                    for window in (None, 512):
                        base = DecodeLaunch(splits, 64, 2, 2, heads_first=heads_first)
                        want = paged_decode_attention(q, k, v, tables, lens, 0.1, sliding_window=window, launch=base)
                        fused = replace(base, fused_merge=True)
                        for _ in range(50):
                            got = paged_decode_attention(q, k, v, tables, lens, 0.1, sliding_window=window,
                                                         launch=fused)
                            assert torch.equal(got, want), (num_heads, num_kv_heads, splits, heads_first, window)
            graph, outs = torch.cuda.CUDAGraph(), []
            with torch.cuda.graph(graph):
                for splits in (2, 4, 8, 16) * 2:
                    outs.append(paged_decode_attention(q, k, v, tables, lens, 0.1,
                                                       launch=DecodeLaunch(splits, 64, 2, 2, fused_merge=True)))
            want = [paged_decode_attention(q, k, v, tables, lens, 0.1, launch=DecodeLaunch(s, 64, 2, 2))
                    for s in (2, 4, 8, 16) * 2]
            for _ in range(100):
                graph.replay()
                torch.cuda.synchronize()
                assert all(torch.equal(o, w) for o, w in zip(outs, want))
    assert int(arrival._COUNTERS[dev].abs().sum()) == 0

"""The batch-invariant kernels of engine.deterministic: the Triton GEMM and per-query attention against their torch
references under TRITON_INTERPRET=1, the CPU paths' invariance (and the default GEMM's lack of it), and on a GPU
bitwise invariance at the 8B model's shapes."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels.invariant.attention import query_attention_rows
from batchgen.kernels.invariant.matmul import linear_rows
from batchgen.kernels.attention.reference import paged_attention_ref
from conftest import run_under_interpreter


def test_the_default_cpu_gemm_depends_on_the_batch_and_linear_rows_does_not():
    """Measured (torch 2.13, MKL): an fp32 F.linear rounds row 0 differently at M = 1 (GEMV) than at M = 3."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1536, 576, generator=g), torch.randn(8, 576, generator=g)
    assert not torch.equal(F.linear(x[:1], w), F.linear(x[:3], w)[:1])
    for dtype in (torch.float32, torch.bfloat16):
        wd, xd = w.to(dtype), x.to(dtype)
        bias = torch.randn(1536, generator=g).to(dtype)
        rows = linear_rows(xd, wd, bias)  # [8, 1536]
        for m in (1, 3, 5):
            assert torch.equal(linear_rows(xd[:m], wd, bias), rows[:m])
        assert torch.equal(linear_rows(xd[4:5], wd, bias), rows[4:5])
        torch.testing.assert_close(rows.float(), F.linear(xd, wd, bias).float(), atol=0.1, rtol=2e-2)


def _cache(g, num_blocks=24, block_size=8, num_kv_heads=2, head_dim=16, dtype=torch.float32):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def test_cpu_attention_rows_of_a_prefill_chunk_equal_the_same_tokens_as_decode_rows():
    """Tokens 10..18 of sequence 0 and 38..39 of sequence 1 as one packed step (row_seq), and each as a decode row
    of its own step (row r = sequence r): bitwise the same, and close to the reference over the whole step."""
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = _cache(g)
    tables = torch.tensor([[3, 5, 7, 0, 0], [1, 2, 4, 6, 8]], dtype=torch.int32)
    q = torch.randn(11, 4, 16, generator=g)
    row_seq = torch.tensor([0] * 9 + [1] * 2, dtype=torch.int32)
    kv_lens = torch.tensor(list(range(11, 20)) + [39, 40], dtype=torch.int32)
    for window, cap in ((None, None), (7, None), (None, 1.5)):
        packed = query_attention_rows(q, k_cache, v_cache, tables, kv_lens, row_seq, 0.25, window, cap)
        for r in (0, 4, 8, 9, 10):
            alone = query_attention_rows(q[r:r + 1], k_cache, v_cache, tables[row_seq[r]:row_seq[r] + 1],
                                         kv_lens[r:r + 1], None, 0.25, window, cap)
            assert torch.equal(alone[0], packed[r])
        ref = paged_attention_ref(q, k_cache, v_cache, torch.tensor([0, 9, 11], dtype=torch.int32),
                                  torch.tensor([19, 40], dtype=torch.int32), tables, 9, 40, 0.25,
                                  sliding_window=window, softcap=cap)
        torch.testing.assert_close(packed, ref, atol=1e-5, rtol=1e-5)


INTERPRET_SCRIPT = """
import torch, sys
sys.path[:0] = ["tests", "tests/kernels"]
from test_invariant_kernels import _cache
from batchgen.kernels.invariant.matmul import gemm_plan, matmul_invariant
import batchgen.kernels.invariant.attention as ia
from batchgen.kernels.invariant.attention import query_attention
from batchgen.kernels.attention.reference import paged_attention_ref
g = torch.Generator().manual_seed(0)
# the GEMM: odd shapes (K not a multiple of BLOCK_K, N not of BLOCK_N), bias, fp32 and fp16 (the interpreter's
# bf16 tl.dot is wrong: bf16 runs in the GPU test), with a fixed split-K (3 K ranges in fp32, 2 in fp16, the last
# one ragged); rows computed at M = 1, 5 and 70, with and without the partials' workspace, are bitwise the same
for dtype, tol, splits in ((torch.float32, 1e-5, 3), (torch.float16, 2e-3, 2)):
    x, w, b = torch.randn(70, 260, generator=g), torch.randn(130, 260, generator=g), torch.randn(130, generator=g)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    assert gemm_plan(130, 260, dtype)[1] == splits
    y = matmul_invariant(x, w, b)
    ref = x.double() @ w.double().T + b.double()
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < tol
    for workspace in (True, False):
        assert torch.equal(matmul_invariant(x, w, b, workspace=workspace), y)
        assert torch.equal(matmul_invariant(x[3:4].contiguous(), w, b, workspace=workspace), y[3:4])
    assert torch.equal(matmul_invariant(x[:5].contiguous(), w, None), matmul_invariant(x, w, None)[:5])
# the attention: a packed step (a 9-token chunk, 2 tokens of another sequence) against the reference, with a
# window and soft-capping; the same tokens as decode rows give the same bits
k_cache, v_cache = _cache(g)
tables = torch.tensor([[3, 5, 7, 0, 0], [1, 2, 4, 6, 8]], dtype=torch.int32)
q = torch.randn(11, 4, 16, generator=g)
row_seq = torch.tensor([0] * 9 + [1] * 2, dtype=torch.int32)
kv_lens = torch.tensor(list(range(11, 20)) + [39, 40], dtype=torch.int32)
for window, cap in ((None, None), (7, None), (None, 1.5)):
    out = query_attention(q, k_cache, v_cache, tables, kv_lens, row_seq, 0.25, window, cap)
    ref = paged_attention_ref(q, k_cache, v_cache, torch.tensor([0, 9, 11], dtype=torch.int32),
                              torch.tensor([19, 40], dtype=torch.int32), tables, 9, 40, 0.25,
                              sliding_window=window, softcap=cap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    decode = query_attention(q[[8, 10]].contiguous(), k_cache, v_cache, tables, kv_lens[[8, 10]].contiguous(),
                             None, 0.25, window, cap)
    assert torch.equal(decode, out[[8, 10]])
padded = query_attention(q[:2].contiguous(), k_cache, v_cache, tables, torch.tensor([5, 0], dtype=torch.int32),
                         None, 0.25)
assert torch.equal(padded[1], torch.zeros_like(padded[1]))  # a graph's padding row (kv_len 0): zeros
# context splits: 300 keys at the real constants (two 256-key splits, merged), then splits of 32 keys, at most 4
# (contexts over 128 keys: 64- and 96-key splits), 2 rows a launch: tokens of one packed step against the
# reference, and each token as a decode row whose block table is only as wide as it needs (fewer workspace
# splits, or none): the same bits
def rows_ref(q, kc, vc, tab, lens, window=None, cap=None):
    return torch.cat([paged_attention_ref(q[i:i + 1], kc, vc, torch.tensor([0, 1], dtype=torch.int32),
                                          lens[i:i + 1], tab, 1, int(lens[i]), 0.25, sliding_window=window,
                                          softcap=cap) for i in range(len(lens))])
real_constants = ia.SPLIT_KEYS, ia.MAX_SPLITS, ia.ROW_SPLITS
kc, vc = _cache(g, num_blocks=48)
tab = torch.randperm(48, generator=g)[:40].view(1, 40).to(torch.int32)
assert ia.SPLIT_KEYS < 300 <= 2 * ia.SPLIT_KEYS
for lens, window, cap, constants in (([256, 300], None, None, real_constants), ([1, 32, 33, 129, 320], None, 1.5,
                                     (32, 4, 8)), ([100, 320], 70, None, (32, 4, 8))):
    ia.SPLIT_KEYS, ia.MAX_SPLITS, ia.ROW_SPLITS = constants
    lens = torch.tensor(lens, dtype=torch.int32)
    qq = torch.randn(len(lens), 4, 16, generator=g)
    out = query_attention(qq, kc, vc, tab, lens, torch.zeros(len(lens), dtype=torch.int32), 0.25, window, cap)
    torch.testing.assert_close(out, rows_ref(qq, kc, vc, tab, lens, window, cap), atol=1e-5, rtol=1e-5)
    for i, n in enumerate(lens.tolist()):
        one = query_attention(qq[i:i + 1], kc, vc, tab[:, :-(-n // 8)], lens[i:i + 1], None, 0.25, window, cap)
        assert torch.equal(one[0], out[i]), (n, window, cap)
ia.SPLIT_KEYS, ia.MAX_SPLITS, ia.ROW_SPLITS = real_constants  # the decoders below run the real ones
"""


DECODER_INTERPRET_SCRIPT = """
import torch, sys
sys.path.insert(0, "tests")
from conftest import make_model, one_sequence_meta
from batchgen.models.registry import DECODERS
from batchgen.attention.kv_cache import KVCache, KVGeometry
# llama; qwen3: q/k norms in rope_kv; gemma2: windows and soft-capping; olmo2: whole-q/k norms, fp32 rotary;
# starcoder2: LayerNorm, biases, plain MLP
for arch in sys.argv[1:]:
    model = make_model(arch, num_layers=1)
    ids = torch.randint(3, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for tri in (True, False):
        caches = [KVCache(KVGeometry.from_config(model.config), 4, 16, torch.float32, torch.device("cpu"))
                  for _ in "ab"]
        whole, part = (DECODERS[arch](model, c, use_triton=tri, deterministic=True) for c in caches)
        # the 12th token's logits: in a 12-token prefill, and as a decode step after an 11-token prefill
        prefill = whole.forward_packed(ids, torch.arange(12), one_sequence_meta(caches[0], 12), torch.tensor([11]))
        part.forward_packed(ids[:11], torch.arange(11), one_sequence_meta(caches[1], 11), torch.tensor([10]))
        decode = part(ids[11:], torch.tensor([11]), torch.tensor([11]), torch.tensor([[0]], dtype=torch.int32),
                      torch.tensor([12], dtype=torch.int32))
        assert torch.equal(prefill, decode), (arch, tri)
        logits[tri] = decode
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)
print("ok")
"""


def test_invariant_kernels_and_decoders_match_their_references_under_triton_interpreter():
    """The kernels against their references (the GEMM's split-K in both modes, the attention's context splits and
    their merge); then the Triton wiring of the batch-invariant decoders (the GEMM,
    the per-query attention's row lengths and sequences in a packed step): a token's logits are the same bits in
    a prefill and in a decode step, Triton path and CPU path alike. One process (the interpreter's start-up
    costs ~6 s)."""
    pytest.importorskip("triton")
    run_under_interpreter(INTERPRET_SCRIPT + DECODER_INTERPRET_SCRIPT, "llama", "qwen3", "gemma2", "olmo2",
                          "starcoder2", timeout=600)


# the 8B model's GEMMs: fused q/k/v, o_proj, fused gate/up, down_proj, the LM head ([N, K] weights)
LLAMA_8B_GEMMS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", LLAMA_8B_GEMMS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_gemm_rows_are_bitwise_the_same_at_m_1_16_and_256_bf16(shape):
    from batchgen.kernels.invariant.matmul import _use_workspace, gemm_plan, matmul_invariant

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16) * 0.02
    x = torch.randn(256, shape[1], generator=g, device="cuda").to(torch.bfloat16)
    full = matmul_invariant(x, w)  # [256, N]
    for i in (0, 7, 15, 200, 255):
        assert torch.equal(matmul_invariant(x[i:i + 1].contiguous(), w)[0], full[i])
        lo = i - i % 16
        assert torch.equal(matmul_invariant(x[lo:lo + 16].contiguous(), w)[i - lo], full[i])
    torch.testing.assert_close(full.float(), F.linear(x, w).float(), atol=0.05, rtol=0.02)
    # the split-K GEMMs (all but the LM head) run M = 1 and 16 with the partials' workspace and M = 256 without:
    # the same arithmetic by construction; both modes at one M besides
    if gemm_plan(*shape, torch.bfloat16)[1] > 1:
        assert _use_workspace(16, *shape, *gemm_plan(*shape, torch.bfloat16)[:2])
        assert not _use_workspace(256, *shape, *gemm_plan(*shape, torch.bfloat16)[:2])
        for m in (16, 256):
            assert torch.equal(matmul_invariant(x[:m], w, workspace=True), matmul_invariant(x[:m], w, workspace=False))


@pytest.mark.gpu
def test_gpu_attention_of_prefill_chunks_equals_decode_rows_bitwise_bf16():
    """A 1,000-token sequence prefilled in chunks of 1, 37 and 512 tokens (each chunk one packed step over the
    cache), beside other sequences, and every token as a decode row: the same bits for every token (8B heads)."""
    from batchgen.kernels.invariant.attention import query_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    num_tokens, block_size = 1000, 16
    k_cache = torch.randn(256, block_size, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(256, block_size, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
    tables = torch.randperm(256, generator=g, device="cuda")[:128].view(2, 64).to(torch.int32)
    q = torch.randn(num_tokens, 32, 128, generator=g, device="cuda").to(torch.bfloat16)
    positions = torch.arange(num_tokens, device="cuda", dtype=torch.int32)
    decode = torch.cat([query_attention(q[i:i + 1], k_cache, v_cache, tables[:1], positions[i:i + 1] + 1, None,
                                        0.088) for i in range(num_tokens)])
    for chunk in (1, 37, 512):
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            rows = torch.cat([q[start:end], q[:3]])  # the chunk, then 3 tokens of the other sequence
            lens = torch.cat([positions[start:end] + 1, torch.tensor([700, 800, 900], device="cuda",
                                                                    dtype=torch.int32)])
            seqs = torch.tensor([0] * (end - start) + [1] * 3, device="cuda", dtype=torch.int32)
            out = query_attention(rows.contiguous(), k_cache, v_cache, tables, lens, seqs, 0.088)
            assert torch.equal(out[:end - start], decode[start:end])


@pytest.mark.gpu
def test_gpu_attention_over_3000_keys_chunked_equals_decode_rows_across_split_and_table_widths_bf16():
    """A 3,000-token sequence (12 context splits of 256 keys, merged) beside a 1,000-token one: tokens of packed
    steps (chunks of 512 and 37, the step's block table just wide enough) and the same tokens as decode rows of a
    graph-wide block table (max_model_len 8,192: the workspace's 16 split slots), at batches of 1 and 64: bitwise
    the same (8B heads)."""
    from batchgen.kernels.invariant.attention import query_attention
    from batchgen.kernels.attention.reference import paged_attention_ref

    g = torch.Generator(device="cuda").manual_seed(1)
    block_size = 16
    k_cache = torch.randn(512, block_size, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(512, block_size, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
    wide = torch.zeros(2, 512, dtype=torch.int32, device="cuda")  # 8,192 keys a row
    wide[:, :188] = torch.randperm(512, generator=g, device="cuda")[:376].view(2, 188).to(torch.int32)
    q = torch.randn(3000, 32, 128, generator=g, device="cuda").to(torch.bfloat16)
    i32 = dict(device="cuda", dtype=torch.int32)
    picks = torch.tensor([0, 255, 256, 511, 999, 1000, 2047, 2560, 2999], device="cuda")
    decode = {}
    for batch in (1, 64):  # the picked tokens as decode rows, with 63 rows of the other sequence beside them
        for p in picks.tolist():
            rows = torch.cat([q[p:p + 1], q[:batch - 1]])
            lens = torch.cat([torch.tensor([p + 1], **i32), torch.arange(batch - 1, **i32) * 15 + 1])
            seqs = torch.tensor([0] + [1] * (batch - 1), **i32)
            out = query_attention(rows.contiguous(), k_cache, v_cache, wide, lens, seqs, 0.088)
            assert decode.setdefault(p, out[0]).equal(out[0]), (batch, p)
    for chunk in (512, 37):
        for start in range(0, 3000, chunk):
            end = min(start + chunk, 3000)
            hit = picks[(picks >= start) & (picks < end)]
            if len(hit) == 0:
                continue
            rows = torch.cat([q[start:end], q[:2]])
            lens = torch.cat([torch.arange(start + 1, end + 1, **i32), torch.tensor([1000, 999], **i32)])
            seqs = torch.tensor([0] * (end - start) + [1] * 2, **i32)
            narrow = wide[:, :-(-max(end, 1000) // block_size)].contiguous()  # both sequences' keys, no more
            out = query_attention(rows.contiguous(), k_cache, v_cache, narrow, lens, seqs, 0.088)
            for p in hit.tolist():
                assert torch.equal(out[p - start], decode[p]), (chunk, p)
    ref = paged_attention_ref(q[2999:3000].float(), k_cache.float(), v_cache.float(), torch.tensor([0, 1], **i32),
                              torch.tensor([3000], **i32), wide[:1], 1, 3000, 0.088)
    torch.testing.assert_close(decode[2999].float(), ref[0], atol=2e-2, rtol=2e-2)

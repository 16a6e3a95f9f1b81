"""Does Programmatic Dependent Launch (PDL) pay off for chains of small memory-bound Triton kernels in a CUDA graph?

    python3 bench/pdl_chain.py [--layers 32] [--reps 30] [--json out.json]   # GPU, sm_90+: ~1-2 min (estimate)
    python3 bench/pdl_chain.py --check-compile     # CPU: compile every kernel variant for sm_90, run nothing

Status: compile-checked for sm_90 and the plain kernels' math interpreted on CPU; not yet run on a GPU.

Mimics an FP8 Llama-8B decode step's weight streaming: per layer and per projection (N, K) = qkv (6144, 4096),
o (4096, 4096), gate_up (28672, 4096), down (4096, 14336): (a) a row kernel, RMSNorm of the first K columns of its
input [M, >= K] bf16 -> fp8 e4m3 + one scale per row and 128 columns; (b) a split-K fp8 GEMM out = xq @ W^T with
128x128 block weight scales, one program per (64-column tile, K split), fp32 partials, splits chosen as batchgen's
decode GEMM chooses them (batchgen/kernels/splitk_common.split_count: 4, 4, 1, 7 at M = 32 on 132 SMs); (c) the
split-K reduce in split order -> bf16 (none where splits = 1: the GEMM stores bf16 itself). Each kernel reads its
predecessor's output: one dependent chain, 11 kernels a layer. Every layer has its own weights (~218 MB), so the
32 layers' 7 GB never stay in L2.

Variants: `plain` (no grid-dependency instructions, ordinary launches), and PDL (launch_pdl=True on every kernel):
each kernel first does what needs no predecessor (index math; the norm's weight; the GEMM's first weight tile and
its scales), then gdc_wait() before it reads its predecessor's output. `pdl-early` calls gdc_launch_dependents()
at the kernel's start (the successor may launch once every program of this kernel has started), `pdl-late` after
the last load of the predecessor's data (GEMM: after the K loop); `pdl-early-l2` as pdl-early and the GEMM also
prefetches its next --l2-tiles weight tiles into L2 (prefetch.global.L2) before the wait. All are the same
arithmetic: outputs must equal plain's bit for bit (a missing wait would race and differ).
Each variant runs eager and captured in one CUDA graph; the graph's edges are read back (cuGraphGetEdges_v2) to
show whether capture kept the programmatic ones. Timed: median of --reps runs per (variant, mode), interleaved,
CUDA events, after warm-up; weight GB/s; the floor = weight bytes at the device-to-device copy rate (read +
write bytes of a 2 GiB copy) measured in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP, BLOCK_N, BLOCK_K, REDUCE_BLOCK = 128, 64, 128, 1024
# variant -> (PDL: 0 off / 1 trigger at start / 2 trigger after the last dependent load, L2 prefetch on)
VARIANTS = {"plain": (0, False), "pdl-early": (1, False), "pdl-late": (2, False), "pdl-early-l2": (1, True)}


def _splitk_common():
    """batchgen's split rule, loaded by file (importing the package would pull in its dependencies)."""
    spec = importlib.util.spec_from_file_location("splitk_common", f"{ROOT}/batchgen/kernels/splitk_common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@triton.jit
def _norm_quant_kernel(x_ptr, stride_x, nw_ptr, q_ptr, s_ptr, K, eps, NG: tl.constexpr, GROUP: tl.constexpr,
                       PDL: tl.constexpr):
    """Row m: y = x[m, :K] * rsqrt(mean(x^2) + eps) * nw -> q [M, K] fp8 and s [M, K / GROUP] (y = q * s)."""
    row = tl.program_id(0)
    cols = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [NG, GROUP]
    mask = cols < K
    nw = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # no kernel of the chain writes it
    if PDL == 1:
        gdc_launch_dependents()
    if PDL > 0:
        gdc_wait()  # the predecessor's output is complete and visible past this point
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL == 2:
        gdc_launch_dependents()
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / K + eps)
    y = x * rstd * nw
    scale = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-10) / 448.0  # [NG]
    tl.store(q_ptr + row * K + cols, (y / scale[:, None]).to(q_ptr.dtype.element_ty), mask=mask)
    g = tl.arange(0, NG)
    tl.store(s_ptr + row * (K // GROUP) + g, scale, mask=g < K // GROUP)


@triton.jit
def _gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, per_split, stride_cs, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, L2_TILES: tl.constexpr):
    """Program (column tile, split): sum over its k blocks of (A_fp8 @ B_fp8^T)[block] * a_s[m, kb] * b_s[n/128, kb]
    in fp32 -> c + split * stride_cs (fp32 partial, or the bf16 output with one split). K % BLOCK_K == 0."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    kbs = K // BLOCK_K
    kb_first = split * per_split
    kb_end = tl.minimum(kb_first + per_split, kbs)
    offs_m = tl.arange(0, BLOCK_M) % M  # rows past M wrap (loads in bounds), not stored
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = kb_first * BLOCK_K + tl.arange(0, BLOCK_K)
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    bs_ptrs = bs_ptr + (offs_n // 128) * kbs
    # independent prologue: the first weight tile and its scales (no kernel of the chain writes weights)
    b = tl.load(b_ptrs)
    b_s = tl.load(bs_ptrs + kb_first)
    for t in tl.static_range(1, L2_TILES + 1):  # the next weight tiles into L2: one line (128 B) per weight row
        lines = b_ptr + offs_n.to(tl.int64) * K + tl.minimum(kb_first + t, kb_end - 1) * BLOCK_K
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // dummy $0", "=r,l", [lines],
                                  dtype=tl.int32, is_pure=False, pack=1)
    if PDL == 1:  # the successor may launch once every program of this grid has got here (or exited)
        gdc_launch_dependents()
    if PDL > 0:  # blocks until the predecessor grid has completed and its writes are visible
        gdc_wait()
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    as_ptrs = as_ptr + offs_m * kbs
    acc = tl.dot(tl.load(a_ptrs), b) * tl.load(as_ptrs + kb_first)[:, None] * b_s[None, :]
    for kb in range(kb_first + 1, kb_end):
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        acc += tl.dot(a, b) * tl.load(as_ptrs + kb)[:, None] * tl.load(bs_ptrs + kb)[None, :]
    if PDL == 2:
        gdc_launch_dependents()
    rows = tl.arange(0, BLOCK_M)
    out = c_ptr + split.to(tl.int64) * stride_cs + rows[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None])


@triton.jit
def _reduce_kernel(p_ptr, c_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """c [M, N] = sum over s = 0, 1, ... of p [s, M, N] in fp32, in split order, rounded once to c's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    if PDL == 1:
        gdc_launch_dependents()
    if PDL > 0:
        gdc_wait()
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    if PDL == 2:
        gdc_launch_dependents()
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


class Chain:
    """Weights of `layers` layers and the activation buffers (shared by the layers, as an engine's are)."""

    def __init__(self, layers: int, rows: int, device, sms: int, shapes=SHAPES, empty: bool = False):
        rule = _splitk_common()

        def new(*shape, dtype=torch.bfloat16):  # empty: compile-only (CPU, nothing is read)
            if empty:
                return torch.empty(*shape, device=device, dtype=dtype)
            return torch.randn(*shape, device=device, dtype=torch.bfloat16).to(dtype)

        assert 0 < rows <= rule.MAX_BLOCK_M, "one row tile: M <= 64"
        self.rows, self.shapes, self.block_m = rows, shapes, rule.block_m_for(rows)
        self.splits = {}
        for p, (n, k) in shapes.items():
            assert n % BLOCK_N == 0 and k % BLOCK_K == 0, (p, n, k)
            kbs = k // BLOCK_K
            self.splits[p] = rule.split_sizes(kbs, rule.split_count(rows, n, kbs, BLOCK_N, sms))
        self.layers = [{p: (new(n, k, dtype=torch.float8_e4m3fn),  # weight, its block scales, the norm's weight
                            torch.full((-(-n // 128), k // 128), k ** -0.5, device=device),
                            1.0 + 0.1 * new(k))
                        for p, (n, k) in shapes.items()} for _ in range(layers)]
        self.weight_bytes = layers * sum(n * k for n, k in shapes.values())
        hidden = next(iter(shapes.values()))[1]
        self.x_in = new(rows, hidden)
        self.q = {k: torch.empty(rows, k, device=device, dtype=torch.float8_e4m3fn) for _, k in shapes.values()}
        self.s = {k: torch.empty(rows, k // GROUP, device=device) for _, k in shapes.values()}
        self.out = {p: torch.empty(rows, n, device=device, dtype=torch.bfloat16) for p, (n, _) in shapes.items()}
        self.part = {p: torch.empty(self.splits[p][1], rows, n, device=device) for p, (n, _) in shapes.items()
                     if self.splits[p][1] > 1}
        self.kernels = len(self.layers) * sum(2 + (s > 1) for _, s in self.splits.values())

    def run(self, variant: str, l2_tiles: int = 0, compile_only: list | None = None) -> torch.Tensor:
        """Launch the whole chain (compile_only: a list -> compile each launch for the active target instead,
        appending (variant, kernel name, CompiledKernel))."""
        pdl, l2 = VARIANTS[variant]
        opts = dict(PDL=pdl, launch_pdl=pdl > 0)

        def launch(kernel, grid, *args, **kwargs):
            if compile_only is None:
                kernel[grid](*args, **kwargs, **opts)
            else:
                compile_only.append((variant, kernel.fn.__name__, kernel.warmup(*args, grid=grid, **kwargs, **opts)))

        src, m = self.x_in, self.rows
        for layer in self.layers:
            for p, (n, k) in self.shapes.items():
                w, ws, nw = layer[p]
                ng = triton.next_power_of_2(k // GROUP)
                launch(_norm_quant_kernel, (m,), src, src.stride(0), nw, self.q[k], self.s[k], k, 1e-6, NG=ng,
                       GROUP=GROUP, num_warps=8 if ng * GROUP <= 4096 else 16)
                per_split, splits = self.splits[p]
                c = self.part.get(p, self.out[p])
                launch(_gemm_kernel, (n // BLOCK_N, splits), self.q[k], self.s[k], w, ws, c, m, n, k, per_split,
                       c.stride(0) if splits > 1 else 0, BLOCK_M=self.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                       L2_TILES=l2_tiles if l2 else 0, num_warps=4, num_stages=4)
                if splits > 1:
                    launch(_reduce_kernel, (triton.cdiv(m * n, REDUCE_BLOCK),), c, self.out[p], m * n,
                           SPLITS=splits, BLOCK=REDUCE_BLOCK, num_warps=4)
                src = self.out[p]
        return src


def graph_edge_types(graph_handle: int) -> dict | str:
    """Edge counts of a cudaGraph_t by (type, from_port): type 1 = programmatic (CUDA driver API, CUDA >= 12.3)."""
    try:
        get_edges = ctypes.CDLL("libcuda.so.1").cuGraphGetEdges_v2
        n = ctypes.c_size_t(0)
        assert get_edges(ctypes.c_void_p(graph_handle), None, None, None, ctypes.byref(n)) == 0
        nodes = (ctypes.c_void_p * n.value)
        data = (ctypes.c_uint8 * (8 * n.value))()  # CUgraphEdgeData: from_port, to_port, type, reserved[5]
        assert get_edges(ctypes.c_void_p(graph_handle), nodes(), nodes(), data, ctypes.byref(n)) == 0
    except (AttributeError, AssertionError, OSError) as e:
        return f"n/a ({type(e).__name__})"
    counts: dict = {}
    for i in range(n.value):
        key = ("programmatic" if data[8 * i + 2] == 1 else f"type{data[8 * i + 2]}") + f"/port{data[8 * i]}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def check_compile(variants: list[str], l2_tiles: int) -> bool:
    """Compile every launch of one layer for sm_90 on this machine (tests/hopper_compile.py's driver: no GPU; not
    its install(), which also interprets each launch: Triton's interpreter cannot run gdc_wait / _launch_dependents,
    so the PDL kernels are compiled only; tests/test_pdl_chain_compiles.py interprets the plain ones) and
    check the machine code (SASS, from the nvdisasm that ships with Triton): griddepcontrol.launch_dependents
    (SASS PREEXIT) and .wait (ACQBULK) exactly in the PDL variants, launch_pdl in their metadata, and in the GEMM
    global loads (the first weight tile) scheduled before the wait, L2 prefetches (CCTL.E.PML2) where asked."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from hopper_compile import HopperCompileOnly  # an sm_90 target and no device: compile, never launch
    triton.runtime.driver.set_active(HopperCompileOnly())
    built: list = []
    chain = Chain(1, 32, "cpu", 132, empty=True)
    for v in variants:
        chain.run(v, l2_tiles, compile_only=built)
    ok, seen = True, set()
    for v, name, kern in built:
        if (v, kern.hash) in seen:
            continue
        seen.add((v, kern.hash))
        sass, pdl, gemm = kern.asm["sass"], VARIANTS[v][0] > 0, name == "_gemm_kernel"
        wait, trig = sass.find("ACQBULK"), sass.find("PREEXIT")
        early = "LDG" in sass[:wait] if wait >= 0 else False
        prefetch = "CCTL.E.PML2" in sass
        good = ((wait >= 0) == pdl and (trig >= 0) == pdl and bool(kern.metadata.launch_pdl) == pdl
                and (early or not (gemm and pdl)) and prefetch == (gemm and VARIANTS[v][1] and l2_tiles > 0))
        ok &= good
        print(f"{v:13s} {name:19s} launch_pdl={int(kern.metadata.launch_pdl)} wait={int(wait >= 0)} "
              f"trigger={int(trig >= 0)} load-before-wait={int(early)} l2-prefetch={int(prefetch)} "
              f"{'ok' if good else 'FAIL'}")
    print(f"{len(seen)} kernels compiled for sm_90: {'ok' if ok else 'FAIL'}")
    return ok


def copy_bandwidth(gib: float = 2.0, reps: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read + written (the HBM traffic)."""
    src = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def capture(chain: Chain, variant: str, l2_tiles: int):
    """The chain captured in one CUDA graph, and its edges by type (keep_graph: torch >= 2.8 keeps the cudaGraph_t
    to read back; else the edges are not read)."""
    try:
        graph, kept = torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:
        graph, kept = torch.cuda.CUDAGraph(), False
    with torch.cuda.graph(graph):
        chain.run(variant, l2_tiles)
    if kept:
        graph.instantiate()
    return graph, graph_edge_types(graph.raw_cuda_graph()) if kept else "n/a (no keep_graph)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=32, help="M, the decode batch (<= 64)")
    ap.add_argument("--reps", type=int, default=30, help="timed runs per (variant, mode), after 3 warm-ups")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    ap.add_argument("--l2-tiles", type=int, default=3, help="weight tiles pdl-early-l2 prefetches into L2")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--check-compile", action="store_true", help="CPU: compile every variant for sm_90, run none")
    args = ap.parse_args()
    variants = args.variants.split(",")
    assert "plain" in variants and set(variants) <= set(VARIANTS), variants
    if args.check_compile:
        return 0 if check_compile(variants, args.l2_tiles) else 1
    assert torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0), "PDL needs sm_90 or later"
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    chain = Chain(args.layers, args.rows, "cuda", props.multi_processor_count)
    copy_bps = copy_bandwidth()
    floor_ms = chain.weight_bytes / copy_bps * 1e3
    print(f"{props.name}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}: "
          f"{args.layers} layers x {chain.kernels // args.layers} kernels, M = {args.rows}, splits "
          f"{ {p: s for p, (_, s) in chain.splits.items()} }; weights {chain.weight_bytes / 1e9:.2f} GB; copy "
          f"{copy_bps / 1e9:.0f} GB/s (read + write) -> floor {floor_ms:.3f} ms")

    outputs, runs, edges = {}, {}, {}
    for v in variants:  # eager first: compiles, and the reference outputs
        outputs[(v, "eager")] = chain.run(v, args.l2_tiles).clone()
        runs[(v, "eager")] = lambda v=v: chain.run(v, args.l2_tiles)
    for v in variants:
        graph, edges[v] = capture(chain, v, args.l2_tiles)
        graph.replay()
        outputs[(v, "graph")] = chain.out[list(chain.shapes)[-1]].clone()  # what run() returns
        runs[(v, "graph")] = graph.replay
    torch.cuda.synchronize()
    ref = outputs[("plain", "eager")].view(torch.int16)
    exact = {key: bool(torch.equal(out.view(torch.int16), ref)) for key, out in outputs.items()}

    times: dict = {key: [] for key in runs}
    for i in range(args.reps + 3):  # interleaved: drifts (clocks, temperature) hit every variant alike
        for key, fn in runs.items():
            torch.cuda.synchronize()  # an idle GPU at the start: eager time includes the host's launch gaps
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            if i >= 3:
                times[key].append(start.elapsed_time(end))
    base = {mode: statistics.median(times[("plain", mode)]) for mode in ("eager", "graph")}
    rows = []
    print(f"{'variant':13s} {'mode':5s} {'ms/chain':>9s} {'min':>7s} {'GB/s':>6s} {'floor %':>7s} "
          f"{'us/kernel over floor':>20s} {'vs plain':>8s}  bits   graph edges")
    for (v, mode), ts in times.items():
        ms = statistics.median(ts)
        row = dict(variant=v, mode=mode, ms=ms, ms_min=min(ts), weight_GBps=chain.weight_bytes / ms / 1e6,
                   floor_pct=100 * floor_ms / ms, us_per_kernel_over_floor=(ms - floor_ms) * 1e3 / chain.kernels,
                   speedup_vs_plain=base[mode] / ms, bit_exact=exact[(v, mode)],
                   edges=edges[v] if mode == "graph" else None)
        rows.append(row)
        print(f"{v:13s} {mode:5s} {ms:9.3f} {min(ts):7.3f} {row['weight_GBps']:6.0f} {row['floor_pct']:6.1f}% "
              f"{row['us_per_kernel_over_floor']:20.2f} {row['speedup_vs_plain']:7.3f}x  "
              f"{'ok' if row['bit_exact'] else 'FAIL':4s}   {row['edges'] if mode == 'graph' else ''}")
    all_exact = all(exact.values())
    print(f"outputs equal plain eager's bit for bit: {'ok' if all_exact else 'FAIL'}; finite: "
          f"{bool(torch.isfinite(outputs[('plain', 'eager')].float()).all())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=props.name, torch=torch.__version__, cuda=torch.version.cuda,
                           triton=triton.__version__, layers=args.layers, rows=args.rows, reps=args.reps,
                           kernels=chain.kernels, splits={p: s for p, (_, s) in chain.splits.items()},
                           l2_tiles=args.l2_tiles, weight_bytes=chain.weight_bytes, copy_GBps=copy_bps / 1e9,
                           floor_ms=floor_ms, bit_exact=all_exact, results=rows), f, indent=1)
    return 0 if all_exact else 1


if __name__ == "__main__":
    sys.exit(main())

"""Where the keys a step writes differ by path, bit for bit: rope_kv (default tiles, one token a program), the fused
decode kernel (one and two splits) and rope_kv_ref (torch eager), at Qwen3-8B's (128-dim) and Gemma3's (256-dim)
heads, fp32 and bf16, with and without the q/k norm; counts of values differing from rope_kv's and the first few. On
the H200 (2026-12-03, bench/results/2026-12-03-fp8-kv-fp16-tiles.md): in bf16 rope_kv alone differs (its rotation
contracted into an FMA).

    python3 bench/qk_rotation_bits.py [cuda|cpu]    (cpu: under TRITON_INTERPRET=1)
"""
import sys
import torch
from batchgen.kernels.attention.decode_launch import DecodeLaunch
from batchgen.kernels.attention.paged_decode import paged_decode_rope_attention
from batchgen.kernels.attention.rope_kv import QKNorm, rope_kv, rope_kv_ref

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
heads, kv_heads, block_size, seqs = 32, 8, 16, 3
g = torch.Generator().manual_seed(0)
tables = torch.arange(2 * seqs, dtype=torch.int32).view(seqs, 2)
lens = torch.tensor([5, 17, 30], dtype=torch.int32)
pos = lens.long() - 1
slots = tables.long()[torch.arange(seqs), pos // block_size] * block_size + pos % block_size
tables, lens, slots = tables.to(dev), lens.to(dev), slots.to(dev)
for head_dim, unit in ((128, False), (256, True)):
    for dtype in (torch.float32, torch.bfloat16):
        qkv = (torch.randn(seqs, (heads + 2 * kv_heads) * head_dim, generator=g) * 2).to(dev, dtype)
        angles = pos[:, None].float() * torch.linspace(0.1, 1.0, head_dim)[None, :]
        cos, sin = angles.cos().to(dev, dtype), angles.sin().to(dev, dtype)
        norm = QKNorm((torch.randn(2, head_dim, generator=g) * 0.3 + 1.0).to(dev, dtype), 1e-6, unit_offset=unit)
        for qk in (norm, None):
            cache = torch.zeros(2 * seqs, block_size, kv_heads, head_dim, dtype=dtype, device=dev)
            refs = {}
            for name in ("rope_kv", "rope_kv_bt1", "torch_ref", "decode1", "decode2"):
                k, v = cache.clone(), cache.clone()
                if name == "rope_kv":
                    rope_kv(qkv, cos, sin, slots, k, v, heads, kv_heads, qk_norm=qk, use_triton=True)
                elif name == "rope_kv_bt1":
                    rope_kv(qkv, cos, sin, slots, k, v, heads, kv_heads, qk_norm=qk, use_triton=True, block_tokens=1)
                elif name == "torch_ref":
                    rope_kv_ref(qkv, cos, sin, slots, k, v, heads, kv_heads, qk_norm=qk)
                else:
                    paged_decode_rope_attention(qkv, cos, sin, slots, k, v, tables, lens, 0.1, heads,
                                                launch=DecodeLaunch(int(name[-1]), 16, 4), qk_norm=qk)
                refs[name] = k.flatten(0, 1)[slots]  # [seqs, kv_heads, head_dim]
            base = refs["rope_kv"]
            line = [f"hd {head_dim} {str(dtype)[6:]} norm {qk is not None}:"]
            for name, k in refs.items():
                diff = (k.float() != base.float())
                line.append(f"{name} {int(diff.sum())}")
            print(" ".join(line))
            d = (refs["decode1"].float() != base.float())
            if d.any():
                idx = d.nonzero()[:6].tolist()
                for s, h, c in idx:
                    print(f"   seq {s} head {h} dim {c}: decode {refs['decode1'][s, h, c].item():.6g} rope_kv "
                          f"{base[s, h, c].item():.6g} torch {refs['torch_ref'][s, h, c].item():.6g}")
                print("   dims differing:", sorted(set(c for _, _, c in d.nonzero().tolist()))[:40])

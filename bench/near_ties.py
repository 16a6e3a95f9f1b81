"""Where two greedy runs of the same rows part, was it a floating-point near-tie?

Two runs of one job with different worker counts batch each row with different neighbours, so GEMM kernel choice,
split-K and attention splits (hence fp32 reduction order) differ, and greedy decoding can flip where the two best
logits are within rounding of each other. This checks that claim instead of assuming it: an independent reference
(transformers' `generate`, fp32, greedy, with its logits) re-runs every differing row; at the step where the outputs
part, the logit gap between the two tokens chosen should be tiny next to the top-2 margins at ordinary steps.

Token ids, not text, are compared (output.keep_token_ids): a random model's bytes are often not valid UTF-8, so
characters do not map back to steps. If the reference follows one of the two outputs to the part step, the gap
between the two tokens chosen there, on its logits, is the gap both runs faced; if it parts from both earlier, that
earlier step is itself a part caused by batch composition, and the gap between its token and the closer output's
is taken instead.
"""

from __future__ import annotations

import torch


def _common_len(x: list[int], y: list[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def check(model_dir, prompts: list[str], a: list[list[int]], b: list[list[int]], max_new_tokens: int,
          batch_size: int = 64) -> dict:
    """prompts[i] produced the differing completions (token ids) a[i] and b[i]. At the step where they part, on the
    reference's logits: the gap between the two tokens chosen there; against the top-1 minus top-2 margin over
    every reference step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    gaps, all_margins, records = [], [], []
    for i in range(0, len(prompts), batch_size):
        batch = tok(prompts[i:i + batch_size], return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [B, steps, V]
        top2 = logits.topk(2, dim=-1).values
        all_margins.append((top2[..., 0] - top2[..., 1]).flatten())
        for j, ref in enumerate(out.sequences[:, batch["input_ids"].shape[1]:].tolist()):
            ca, cb = a[i + j], b[i + j]
            part = _common_len(ca, cb)
            fa, fb = _common_len(ref, ca), _common_len(ref, cb)
            if max(fa, fb) >= part:  # the reference saw the same context at the part: the two runs' tokens there
                step, pair = part, (ca[part], cb[part])
            else:  # the reference parted from both earlier: its token and the closer output's there
                step = max(fa, fb)
                pair = (ref[step], (ca if fa >= fb else cb)[step])
            if step >= logits.shape[1]:
                continue
            gap = float((logits[j, step, pair[0]] - logits[j, step, pair[1]]).abs())
            gaps.append(gap)
            records.append({"part_step": part, "reference_step": step, "tokens": list(pair), "gap": round(gap, 6),
                            "reference_top2": logits[j, step].topk(2).indices.tolist()})
    del model
    every = torch.cat(all_margins)
    gap = torch.tensor(gaps)
    return {
        "rows_checked": len(prompts),
        "reference_shares_the_part_context": sum(r["part_step"] == r["reference_step"] for r in records),
        "gap_max": float(gap.max()) if len(gap) else None,
        "gap_median": float(gap.median()) if len(gap) else None,
        "all_steps_top2_margin_p1_p10_p50": [float(v) for v in every.quantile(torch.tensor([0.01, 0.1, 0.5]))],
        # how rare a margin as small as the largest gap is at an ordinary step
        "fraction_of_steps_at_or_below_gap_max": float((every <= gap.max()).float().mean()) if len(gap) else None,
        "rows": records,
    }

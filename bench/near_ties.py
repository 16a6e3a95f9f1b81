"""Where two greedy runs of the same rows part, was it a floating-point near-tie?

Two runs of one job with different worker counts batch each row with different neighbours, so GEMM kernel choice,
split-K and attention splits (hence fp32 reduction order) differ, and greedy decoding can flip where the two best
logits are within rounding of each other. This checks that claim instead of assuming it: an independent reference
(transformers' `generate`, fp32, greedy, with its logits) re-runs every differing row; at the token step where the
texts part, the top-1 minus top-2 logit margin should be tiny next to the margins seen at ordinary steps.

For each row, the part point is taken on the reference's own trajectory: if the reference follows one of the two
outputs past the part, its margin there is the margin both runs faced; if it parts from both earlier, that earlier
point is itself a part caused by batch composition, and its margin is taken instead.
"""

from __future__ import annotations

import os

import torch


def _first_step_past(tok, ids: list[int], num_chars: int) -> int:
    """The first step s whose decoded prefix ids[:s+1] is longer than num_chars (binary search; decode is monotone)."""
    lo, hi = 0, len(ids) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tok.decode(ids[:mid + 1])) > num_chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def check(model_dir, prompts: list[str], a: list[str], b: list[str], max_new_tokens: int,
          batch_size: int = 64) -> dict:
    """prompts[i] produced completions a[i] and b[i] (which differ). Returns the margins at the part points and the
    distribution of margins over every reference step, for comparison."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    part_margins, all_margins, ref_follows = [], [], 0
    for i in range(0, len(prompts), batch_size):
        batch = tok(prompts[i:i + batch_size], return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
        logits = torch.stack(out.logits, dim=1).float()  # [B, steps, V]
        top2 = logits.topk(2, dim=-1).values
        margins = (top2[..., 0] - top2[..., 1]).cpu()  # [B, steps]
        all_margins.append(margins.flatten())
        gen = out.sequences[:, batch["input_ids"].shape[1]:].tolist()
        for j, ids in enumerate(gen):
            ca, cb = a[i + j], b[i + j]
            ref = tok.decode(ids)
            part = len(os.path.commonprefix([ca, cb]))
            follows = max(len(os.path.commonprefix([ref, ca])), len(os.path.commonprefix([ref, cb])))
            ref_follows += follows >= part
            step = _first_step_past(tok, ids, min(part, follows))
            # char-to-token boundaries are fuzzy by one step: the smallest margin next to the part point
            part_margins.append(float(margins[j, max(step - 1, 0):step + 2].min()))
    del model
    every = torch.cat(all_margins)
    q = torch.tensor([0.01, 0.1, 0.5])
    part = torch.tensor(part_margins)
    return {
        "rows_checked": len(prompts),
        "reference_follows_one_output_past_the_part": ref_follows,
        "part_margin_max": float(part.max()) if len(part) else None,
        "part_margin_median": float(part.median()) if len(part) else None,
        "all_steps_margin_p1_p10_p50": [float(v) for v in every.quantile(q)],
        # how rare a margin this small is at an ordinary step: the fraction of all steps at or below the largest part margin
        "fraction_of_steps_at_or_below_part_max": float((every <= part.max()).float().mean()) if len(part) else None,
    }

"""`batchgen validate`: everything that can be checked without generating, in a short report."""

from __future__ import annotations

import statistics

from batchgen.errors import JobError
from batchgen.prompts import PromptRenderer, RowError
from batchgen.sources import open_source
from batchgen.job.spec import JobSpec


def audit(spec: JobSpec, sample_rows: int = 1000, show: int = 2) -> str:
    from batchgen.attention.kv_cache import KVGeometry
    from batchgen.runner.loader import load_tokenizer_and_config

    lines = [f"job: ok ({spec.name or 'unnamed'}); output -> {spec.output.dir}"]
    source = open_source(spec.source)
    expected = source.expected_rows
    lines.append(f"source: {source.description}; {expected if expected is not None else 'unknown number of'} rows; "
                 f"columns: {', '.join(source.columns)}")
    try:
        tokenizer, config = load_tokenizer_and_config(spec.model.path, spec.model.gguf_file)
    except (OSError, ValueError) as e:
        raise JobError(f"cannot load the tokenizer/config of model.path {spec.model.path!r}: "
                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    text = config.get_text_config()
    context = spec.engine.max_model_len or getattr(text, "max_position_embeddings", None) or 1 << 30
    geo = KVGeometry.from_config(config)
    lines.append(f"model: {type(config).__name__.removesuffix('Config')}, {geo.num_layers} layers, "
                 f"{text.num_attention_heads} heads ({geo.num_kv_heads} KV), context {context} tokens, "
                 f"vocab {text.vocab_size}")
    max_prompt = spec.prompt.max_prompt_tokens or context - spec.sampling.max_new_tokens
    renderer = PromptRenderer(spec.prompt, tokenizer, source.columns, max(max_prompt, 1))
    lengths, rejects, shown = [], {}, []
    for i, row in enumerate(source):
        if i >= sample_rows:
            break
        if row.columns is None:
            rejects["malformed_row"] = rejects.get("malformed_row", 0) + 1
            continue
        try:
            prompt = renderer.render(row.columns)
            ids = tokenizer.encode(prompt, add_special_tokens=not spec.prompt.chat)  # once: length before policy
            if not ids:
                raise RowError("empty_prompt", "the prompt has no tokens")
            lengths.append(len(ids))
            if len(ids) > max_prompt and spec.prompt.on_too_long == "reject":
                rejects["prompt_too_long"] = rejects.get("prompt_too_long", 0) + 1
            if len(shown) < show:
                shown.append(prompt)
        except RowError as e:
            rejects[e.error_class] = rejects.get(e.error_class, 0) + 1
    for n, p in enumerate(shown):
        lines.append(f"prompt #{n}:\n    " + p.replace("\n", "\n    "))
    if lengths:
        ordered = sorted(lengths)
        p95 = ordered[int(0.95 * (len(ordered) - 1))]
        over = sum(1 for n in lengths if n > max_prompt)
        lines.append(f"prompt tokens over {len(lengths)} rendered rows: min {min(lengths)}, median "
                     f"{statistics.median(lengths):.0f}, p95 {p95}, max {max(lengths)}; {over} exceed the "
                     f"{max_prompt}-token limit (policy: {spec.prompt.on_too_long})")
    if rejects:
        lines.append("rows that would be rejected in the sample: "
                     + ", ".join(f"{k}: {v}" for k, v in sorted(rejects.items())))
    lines.append(f"sampling: n={spec.sampling.n}, max_new_tokens={spec.sampling.max_new_tokens}, "
                 f"temperature={spec.sampling.temperature}, seed={spec.sampling.seed}")
    return "\n".join(lines)

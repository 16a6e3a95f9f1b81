"""What `run` and `validate` refuse from a job's spec and its model's config alone, before any weight loads, with
the same messages: a checkpoint scheme batchgen cannot run, a tensor-parallel split or deterministic mode the model
does not support, token ids outside the vocabulary, and a max_new_tokens that leaves no room for a prompt."""

from __future__ import annotations

from batchgen.config import JobSpec
from batchgen.errors import JobError


def max_prompt_tokens(spec: JobSpec, config) -> int:
    """Refuse what the config alone rules out (JobError naming the key); return the longest prompt a row may have."""
    from batchgen.models.registry import deterministic_reason, tensor_parallel_reason
    from batchgen.quant.loader import check_fp8_checkpoint

    check_fp8_checkpoint(config, spec.model.path)  # an FP8 scheme batchgen cannot run
    reason = tensor_parallel_reason(config, spec.engine.tensor_parallel_size)
    if reason is not None:
        raise JobError(f"engine.tensor_parallel_size {spec.engine.tensor_parallel_size}: {reason}")
    reason = deterministic_reason(config) if spec.engine.deterministic else None
    if reason is not None:  # the model-level checks: models/registry.py
        raise JobError(f"engine.deterministic: {reason}; run without it (no reproducibility guarantee across "
                       f"batch sizes and worker counts)")
    try:
        spec.sampling.check_vocab(config.get_text_config().vocab_size)
    except ValueError as e:
        raise JobError(f"sampling.{e}") from None
    context = spec.engine.context_length(config)
    max_prompt = spec.prompt.max_prompt_tokens or context - spec.sampling.max_new_tokens
    if max_prompt < 1:
        raise JobError(f"sampling.max_new_tokens ({spec.sampling.max_new_tokens}) leaves no room for a prompt "
                       f"in the model's context of {context} tokens")
    return max_prompt

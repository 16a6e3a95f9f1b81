"""What `run` and `validate` refuse from a job's spec and its model's config alone, before any weight loads, with
the same messages: a checkpoint scheme batchgen cannot run, a tensor-parallel split or deterministic mode the model
does not support, token ids outside the vocabulary, a max_new_tokens that leaves no room for a prompt, and an
explicit K/V cache size larger than the device's whole memory."""

from __future__ import annotations

from batchgen.config import JobSpec
from batchgen.errors import JobError


def _longest_context(text) -> int | None:
    """The longest context the model's config allows: max_position_embeddings, stretched by a rope scaling factor
    (yarn, linear, dynamic: factor x original_max_position_embeddings; llama3's own value is already the stretched
    one); None when the config names no max_position_embeddings."""
    own = getattr(text, "max_position_embeddings", None)
    if not isinstance(own, int):
        return None
    rope = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None) or {}
    longest = own
    for params in [rope, *rope.values()] if isinstance(rope, dict) else []:  # per layer type in some configs
        factor = params.get("factor") if isinstance(params, dict) else None
        if isinstance(factor, (int, float)) and factor > 1:
            base = params.get("original_max_position_embeddings") or own
            longest = max(longest, int(base * factor))
    return longest


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
    longest = _longest_context(config.get_text_config())
    if spec.engine.max_model_len is not None and longest is not None and spec.engine.max_model_len > longest:
        raise JobError(f"engine.max_model_len {spec.engine.max_model_len} exceeds the model's context of {longest} "
                       f"tokens (max_position_embeddings, with its rope scaling): positions beyond it were never "
                       f"trained. Leave it unset, or set at most {longest}")
    context = spec.engine.context_length(config)
    max_prompt = spec.prompt.max_prompt_tokens or context - spec.sampling.max_new_tokens
    if max_prompt < 1:
        raise JobError(f"sampling.max_new_tokens ({spec.sampling.max_new_tokens}) leaves no room for a prompt "
                       f"in the model's context of {context} tokens")
    return max_prompt


def check_kv_cache_fits(spec: JobSpec, config, device) -> None:
    """Refuse (JobError naming the key) a K/V cache asked for explicitly (engine.num_kv_blocks, or on CPU
    engine.cpu_kv_cache_bytes) that is larger than the device's whole memory: the engine would fail only after the
    weights loaded. A lower bound (2-byte elements, 1 with kv_cache_dtype fp8; weights and activations not
    counted), so it never refuses a cache that fits."""
    import os

    import torch

    from batchgen.attention.kv_cache import KVGeometry

    engine = spec.engine
    element = torch.float8_e4m3fn if engine.kv_cache_dtype == "fp8" else torch.bfloat16
    # each tensor-parallel rank holds its share of the KV heads
    per_block = KVGeometry.from_config(config).bytes_per_block(engine.block_size, element) \
        // engine.tensor_parallel_size
    if engine.num_kv_blocks is not None:
        key, value, need = "engine.num_kv_blocks", engine.num_kv_blocks, engine.num_kv_blocks * per_block
    elif device.type == "cpu":
        key, value, need = "engine.cpu_kv_cache_bytes", engine.cpu_kv_cache_bytes, engine.cpu_kv_cache_bytes
    else:
        return  # sized from what is free at start-up
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > total:
        raise JobError(f"{key} ({value:,}) asks for a K/V cache of at least {need / 2**30:,.1f} GiB; {device} has "
                       f"{total / 2**30:,.1f} GiB in all. Lower it, or leave engine.num_kv_blocks null to size the "
                       f"cache from the memory free at start-up")

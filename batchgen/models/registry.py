"""Which decode forward a model runs: a fused decoder registered for its model type, or transformers' modules
with our attention, with the reason printed at start-up. A new architecture is a file in this folder whose
decoder class declares its `model_types`, `unsupported_reason` and capability flags (models/base.py
DecodeForward), plus its line in FAMILIES."""

from __future__ import annotations

import warnings

import torch

from batchgen.attention.kv_cache import KVCache
from batchgen.models import gemma, gemma2, granite, llama, mixtral, olmo2, phi3, qwen_moe, starcoder2
from batchgen.models.base import DecodeForward
from batchgen.models.shard import Shard, divisibility_reason
from batchgen.quant.linear import probe_gemms
from batchgen.quant.scheme import EXPERT_KEYS, invariant_reason, split_reason
from batchgen.models.transformers_forward import TransformersDecode

# one line a fused family
FAMILIES: tuple[type[DecodeForward], ...] = (
    llama.LlamaDecoder,
    gemma.GemmaDecoder,
    gemma2.Gemma2Decoder,
    phi3.Phi3Decoder,
    olmo2.Olmo2Decoder,
    granite.GraniteDecoder,
    starcoder2.Starcoder2Decoder,
    qwen_moe.QwenMoEDecoder,
    mixtral.MixtralDecoder,
)
DECODERS: dict[str, type[DecodeForward]] = {t: family for family in FAMILIES for t in family.model_types}
# the families whose decoders read a Shard (models/shard.py): the Llama layer loop (`LlamaDecoder._hidden`, with its
# `_reduce` after o_proj and the MLP; MoE experts split along the intermediate dimension), Gemma2's and OLMo2's
TENSOR_PARALLEL_TYPES = tuple(t for t, family in DECODERS.items() if family.supports_tensor_parallel)
# the families whose every op is batch-invariant (engine.deterministic; build_deterministic says what is not)
DETERMINISTIC_TYPES = tuple(t for t, family in DECODERS.items() if family.supports_deterministic)


def unsupported_reason(model: torch.nn.Module, max_model_len: int) -> str | None:
    """Why this model has no fused decode forward, or None when it has one."""
    model_type = model.config.get_text_config().model_type
    if model_type not in DECODERS:
        return f"model type {model_type!r} (fused decoders: {', '.join(sorted(DECODERS))})"
    return DECODERS[model_type].unsupported_reason(model, max_model_len)


def build_decode_forward(model: torch.nn.Module, kv_cache: KVCache, use_triton: bool, max_model_len: int,
                         fused_decoder: bool = True, compile: bool = False, shard: Shard | None = None,
                         deterministic: bool = False, fp8_gemm: str = "auto") -> DecodeForward:
    """The decode forward for this model. A fused decoder that fails its first step on the device warns and
    falls back to transformers' modules (with a `shard` or `deterministic`: raises instead, see build_sharded
    and build_deterministic). `fp8_gemm`: engine.fp8_gemm, the fused decoder's path for quantised GEMMs."""
    # before any CUDA-graph capture; a forced engine.fp8_gemm path the device lacks raises here, not falls back below
    probe_gemms(model.config, kv_cache.k_cache.device, fp8_gemm, fused=fused_decoder and not compile)
    if shard is not None:
        return build_sharded(model, kv_cache, use_triton, max_model_len, shard)
    if deterministic:
        return build_deterministic(model, kv_cache, use_triton, max_model_len)
    reason = "off" if not fused_decoder else "compile requested" if compile else \
        unsupported_reason(model, max_model_len)
    if reason is None:
        fused = DECODERS[model.config.get_text_config().model_type](model, kv_cache, use_triton, fp8_gemm=fp8_gemm)
        reason = fused.check(kv_cache)
        if reason is None:
            return fused
        warnings.warn(f"batchgen: {reason}; decode steps use transformers' modules", stacklevel=3)
    return TransformersDecode(model, kv_cache, use_triton, max_model_len, reason)


# ---- tensor parallelism -------------------------------------------------------------------------------------------


def tensor_parallel_reason(config, size: int) -> str | None:
    """Why a model of this config cannot run split `size` ways, from its config alone (before any weight loads),
    or None. Phrased to follow "engine.tensor_parallel_size N: "."""
    if size == 1:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = text.model_type
    reason = split_reason(config, size)  # a quantised checkpoint's scale blocks
    if reason:
        return reason
    if model_type not in DECODERS:
        return (f"tensor parallelism needs a fused decoder; model type {model_type!r} runs transformers' modules "
                f"(fused decoders with tensor parallelism: {', '.join(sorted(TENSOR_PARALLEL_TYPES))})")
    if model_type not in TENSOR_PARALLEL_TYPES:
        return (f"tensor parallelism is not built for model type {model_type!r}'s fused decoder (built for: "
                f"{', '.join(sorted(TENSOR_PARALLEL_TYPES))})")
    return divisibility_reason(text, size)


def build_sharded(model: torch.nn.Module, kv_cache: KVCache, use_triton: bool, max_model_len: int,
                  shard: Shard) -> DecodeForward:
    """The fused decoder over this rank's shard. No fallback: transformers' modules cannot run a shard, so a
    model without a usable fused decoder raises ValueError, and one whose first step fails raises RuntimeError
    (on one rank only, the other ranks then wait in the step's collectives until their timeout)."""
    reason = tensor_parallel_reason(model.config, shard.size)
    if reason is None and unsupported_reason(model, max_model_len) is not None:
        reason = (f"tensor parallelism needs a fused decoder; this {model.config.get_text_config().model_type!r} "
                  f"model runs transformers' modules ({unsupported_reason(model, max_model_len)})")
    if reason is not None:
        raise ValueError(f"engine.tensor_parallel_size {shard.size}: {reason}")
    fused = DECODERS[model.config.get_text_config().model_type](model, kv_cache, use_triton, shard=shard)
    reason = fused.check(kv_cache)
    if reason is not None:
        raise RuntimeError(f"engine.tensor_parallel_size {shard.size}: {reason}")
    return fused


# ---- engine.deterministic: the fused decoders whose every op is batch-invariant ---------------------------------
# Refused, not warned: a job that asks for reproducible output and silently gets the default numerics would be
# a dataset that is not what it says. Not covered: transformers' modules (cuBLAS GEMMs, torch's attention
# choices), MoE decoders (the grouped expert GEMMs pad each expert's tokens into blocks whose count depends on
# the batch, and the top-k combine), tensor parallelism (all-reduce order and algorithm depend on message size).


class DeterministicUnsupported(ValueError):
    """engine.deterministic asked of a model the batch-invariant decoders cannot run; the message names the key."""


def deterministic_reason(config) -> str | None:
    """Why a model of this config cannot run engine.deterministic, from its config alone (before any weight
    loads), or None. Phrased to follow "engine.deterministic: "."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = text.model_type
    if any(getattr(text, k, None) for k in EXPERT_KEYS):
        return f"batch-invariant mixture-of-experts layers (model type {model_type!r}) are not built"
    reason = invariant_reason(config)  # a quantised checkpoint's GEMMs
    if reason:
        return reason
    if model_type not in DETERMINISTIC_TYPES:
        return (f"batch-invariant kernels exist only in the fused decoders ({', '.join(sorted(DETERMINISTIC_TYPES))}); "
                f"model type {model_type!r} runs transformers' modules")
    return None


def build_deterministic(model: torch.nn.Module, kv_cache: KVCache, use_triton: bool,
                        max_model_len: int) -> DecodeForward:
    """The fused decoder with batch-invariant GEMMs and attention. No fallback: a model the fused layers cannot
    run, or whose first step fails on the device, raises DeterministicUnsupported (naming the key).
    On CUDA that first step (`check`, before any graph capture) runs every weight's GEMM once, which runs the
    fixed-row cuBLAS GEMM's self-check for each kind of weight and fixes its kernel (kernels/invariant/linear.py:
    the choices are `fused.linear.paths`; a weight that fails runs the Triton GEMM, with a warning)."""
    reason = deterministic_reason(model.config) or unsupported_reason(model, max_model_len)
    if reason is not None:
        raise DeterministicUnsupported(f"engine.deterministic: {reason}; run without engine.deterministic (no reproducibility "
                         f"guarantee across batch sizes), or use a model the fused decoders serve")
    fused = DECODERS[model.config.get_text_config().model_type](model, kv_cache, use_triton, deterministic=True)
    reason = fused.check(kv_cache)
    if reason is not None:
        raise DeterministicUnsupported(f"engine.deterministic: the batch-invariant decoder failed its first step on "
                                       f"the device: {reason}")
    return fused

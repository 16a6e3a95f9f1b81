"""Which FP8 checkpoint a config's `quantization_config` describes, read from the config alone (before any weight
loads), or why batchgen cannot run it.

Formats (what transformers loads; each checkpoint stores value = fp8 weight * scale):
  - `quant_method: fp8` (transformers' FineGrainedFP8Config; Qwen3-FP8, DeepSeek): `weight_scale_inv` per block of
    `weight_block_size` [rows, cols] ([128, 128]), or one per tensor when it is null; activations dynamic per
    token and group of `cols` columns;
  - `quant_method: compressed-tensors`, format `float-quantized` (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK):
    `weight_scale` per tensor, channel ([N, 1]), block (`block_structure`) or group (`group_size` columns);
    `input_activations` dynamic per token / group, static per tensor, or null (weight-only);
  - `quant_method: fbgemm_fp8`: `weight_scale` per channel [N, 1], activations per token with their absolute
    max capped at `activation_scale_ub`.
Static activation scales (`input_scale`, `activation_scale`) are read past: activations are quantised dynamically
per token (group) instead, as transformers' compressed-tensors FP8 layers do; it only adds precision.
"""

from __future__ import annotations

from dataclasses import dataclass

FP8_METHODS = ("fp8", "compressed-tensors", "fbgemm_fp8")
# config keys that give a model's expert count (any mixture-of-experts family); registry.py reads them too
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# mixture-of-experts families whose FP8 experts load (quant/modules.py Fp8Experts in place of transformers 5.x's 3-D
# experts module) and run (the fused MoE decoders, models/moe.py)
FP8_MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")


@dataclass(frozen=True)
class Fp8Scheme:
    """An FP8 checkpoint's layout, as the loader and Fp8Linear need it."""

    method: str  # quant_method
    group_n: int  # weight rows per scale block (1: per channel / per group of columns)
    group_k: int | None  # weight columns per scale block, also the activation group; None: per-channel scales
    act_quant: bool  # activations quantised dynamically (False: a weight-only checkpoint)
    scale_key: str  # the scale tensor's name beside each `.weight`: weight_scale_inv | weight_scale
    scale_ub: float | None = None  # fbgemm: cap on an activation row's absolute max

    def describe(self) -> str:
        weights = "per-channel/tensor" if self.group_k is None else f"{self.group_n}x{self.group_k} blocks"
        acts = "dynamic per-token" + ("" if self.group_k is None else f"-group-{self.group_k}") \
            if self.act_quant else "not quantised (weight-only)"
        return f"FP8 {self.method}: weight scales {weights}, activations {acts}"


class UnsupportedFp8(ValueError):
    """A quantization_config batchgen recognises as its own to load but cannot run; the message says why."""


def quant_method(config) -> str | None:
    q = _qconfig(config)
    return None if q is None else str(q.get("quant_method", "")).lower() or None


def is_fp8(config) -> bool:
    """Whether this config's checkpoint is one batchgen's FP8 loader reads (its method is one of FP8_METHODS;
    other quantisation methods are left to transformers)."""
    return quant_method(config) in FP8_METHODS


def parse(config) -> Fp8Scheme:
    """The Fp8Scheme of an FP8 config (`is_fp8`), or UnsupportedFp8 naming the key and value it cannot run."""
    q = _qconfig(config)
    method = quant_method(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if method == "fp8":
        scheme = _fine_grained(q)
    elif method == "fbgemm_fp8":
        ub = q.get("activation_scale_ub")
        scheme = Fp8Scheme(method, 1, None, True, "weight_scale", None if ub is None else float(ub))
    else:
        scheme = _compressed_tensors(q)
    if any(getattr(text, k, None) for k in EXPERT_KEYS):
        if text.model_type not in FP8_MOE_TYPES:
            raise UnsupportedFp8(f"quantization_config.quant_method {method!r} on a mixture-of-experts model of type "
                                 f"{text.model_type!r}: FP8 experts are built for {', '.join(FP8_MOE_TYPES)}")
        if scheme.group_k is None or not scheme.act_quant:
            raise UnsupportedFp8(f"quantization_config ({scheme.describe()}) on a mixture-of-experts model: FP8 "
                                 f"mixture-of-experts checkpoints are built for block-wise scales with dynamic "
                                 f"activations (quant_method fp8 with weight_block_size, or compressed-tensors "
                                 f"block / group weights); use such a checkpoint or a bf16 one")
    return scheme


def split_reason(config, size: int) -> str | None:
    """Why this checkpoint's quantisation cannot be split `size` ways by tensor parallelism, or None: not FP8, or
    a scheme that cannot run at all (the loader's error names that, not this)."""
    if not is_fp8(config):
        return None
    try:
        scheme = parse(config)
    except UnsupportedFp8:
        return None
    return fp8_split_reason(config, scheme.group_n, scheme.group_k, size)


def invariant_reason(config) -> str | None:
    """Why engine.deterministic cannot run this checkpoint's GEMMs (the batch-invariant GEMMs read plain weights
    only), or None."""
    if is_fp8(config):
        return "batch-invariant FP8 GEMMs are not built (the checkpoint's quantization_config is FP8)"
    return None


def fp8_split_reason(config, group_n: int, group_k: int | None, size: int) -> str | None:
    """Why an FP8 checkpoint's block scales cannot be split `size` ways, or None: every rank's slice of a
    column-parallel weight (q, k, v, gate, up, the experts' gate and up) must be whole blocks of group_n rows,
    and of a row-parallel one (o, down, the experts' down) whole blocks of group_k columns. Per-channel scales
    (group_k None) split with their rows."""
    if group_k is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    # (what, its size, also the input columns of a row-parallel weight: o_proj's are q's, down's the MLP's)
    for key, dim, row_parallel in (("num_attention_heads x head_dim", heads * head_dim, True),
                                   ("num_key_value_heads x head_dim", kv_heads * head_dim, False),
                                   ("intermediate_size", getattr(text, "intermediate_size", None), True),
                                   ("moe_intermediate_size", getattr(text, "moe_intermediate_size", None), True),
                                   ("shared_expert_intermediate_size",
                                    getattr(text, "shared_expert_intermediate_size", None), True)):
        per_rank = (dim or 0) // size
        if dim and (per_rank % group_n or (row_parallel and per_rank % group_k)):
            return (f"its {key} ({dim}) split {size} ways is {per_rank} per rank, not whole FP8 scale blocks of "
                    f"{group_n} x {group_k}")
    return None


def _qconfig(config) -> dict | None:
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    return q if isinstance(q, dict) else q.to_dict()


def _block(key: str, value, method: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise UnsupportedFp8(f"quantization_config.{key} {value!r} ({method}): expected [rows, cols]")
    _check_group_k(key, value[1], method)
    return value[0], value[1]


def _check_group_k(key: str, cols: int, method: str) -> None:
    # the Triton GEMMs' k step is one block: a power of two, >= 32 (an fp8 tl.dot's K on Hopper) and <= 512 (the
    # grouped expert GEMM's tiles in shared memory)
    if cols < 32 or cols > 512 or cols & (cols - 1):
        raise UnsupportedFp8(f"quantization_config.{key} ({method}): blocks of {cols} columns; batchgen's FP8 GEMMs "
                             f"take a power of two from 32 to 512 (checkpoints use 128)")


def _fine_grained(q: dict) -> Fp8Scheme:
    if q.get("scale_fmt", "float") != "float":
        raise UnsupportedFp8(f"quantization_config.scale_fmt {q['scale_fmt']!r} (fp8): only float (fp32) scales are "
                             f"built, not UE8M0 exponents")
    if q.get("modules_to_convert"):
        raise UnsupportedFp8(f"quantization_config.modules_to_convert {q['modules_to_convert']!r} (fp8): FP8 "
                             f"embedding tables are not built")
    scheme = str(q.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise UnsupportedFp8(f"quantization_config.activation_scheme {scheme!r} (fp8): dynamic or static")
    block = q.get("weight_block_size")
    if block is None:  # one scale per tensor, expanded per channel on load
        return Fp8Scheme("fp8", 1, None, True, "weight_scale_inv")
    rows, cols = _block("weight_block_size", block, "fp8")
    return Fp8Scheme("fp8", rows, cols, True, "weight_scale_inv")


def _compressed_tensors(q: dict) -> Fp8Scheme:
    where = "quantization_config"
    fmt = q.get("format")
    if fmt != "float-quantized":
        raise UnsupportedFp8(f"{where}.format {fmt!r} (compressed-tensors): batchgen loads FP8 float-quantized "
                             f"checkpoints only")
    if q.get("kv_cache_scheme"):
        raise UnsupportedFp8(f"{where}.kv_cache_scheme (compressed-tensors): its calibrated K/V scales are not read "
                             f"(engine.kv_cache_dtype: fp8 stores K/V in fp8 with scale 1)")
    groups = list((q.get("config_groups") or {}).values())
    if not groups or any(g != groups[0] for g in groups):
        raise UnsupportedFp8(f"{where}.config_groups (compressed-tensors): expected one scheme for every layer, "
                             f"found {len(groups)} different ones")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    key = f"{where}.config_groups.*.weights"
    if weights.get("type") != "float" or weights.get("num_bits") != 8 or weights.get("symmetric") is False:
        raise UnsupportedFp8(f"{key} {{type: {weights.get('type')}, num_bits: {weights.get('num_bits')}, symmetric: "
                             f"{weights.get('symmetric')}}}: batchgen runs symmetric 8-bit float (FP8) weights only")
    strategy = weights.get("strategy")
    if strategy in ("tensor", "channel"):
        rows, cols = 1, None
    elif strategy == "block":
        rows, cols = _block("config_groups.*.weights.block_structure", weights.get("block_structure"),
                            "compressed-tensors")
    elif strategy == "group":
        rows, cols = 1, weights.get("group_size")
        _check_group_k("config_groups.*.weights.group_size", cols or 0, "compressed-tensors")
    else:
        raise UnsupportedFp8(f"{key}.strategy {strategy!r}: tensor, channel, block or group")
    if acts is not None and (acts.get("type") != "float" or acts.get("num_bits") != 8):
        raise UnsupportedFp8(f"{where}.config_groups.*.input_activations {{type: {acts.get('type')}, num_bits: "
                             f"{acts.get('num_bits')}}}: FP8 activations or none")
    return Fp8Scheme("compressed-tensors", rows, cols, acts is not None, "weight_scale")

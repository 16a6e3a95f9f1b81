"""`batchgen bench --weights fp8 | fp8-channel`: random models at a real geometry with FP8 projections, built one
layer at a time on the GPU (a 70B model never exists in bf16), and saved as the FP8 checkpoint format batchgen
loads (for the job workload, which runs `batchgen run` on a folder).

  fp8          block-wise: 128x128 weight blocks, per-token-group-of-128 activations (transformers'
               FineGrainedFP8Config, `quant_method: fp8`; Qwen3-FP8 / DeepSeek): the Triton block-scaled GEMM
  fp8-channel  per-channel weight scales, per-token activations (compressed-tensors FP8_DYNAMIC): _scaled_mm
Weights are normal(0, 0.02) like transformers' init, quantised by kernels/fp8/quant.quantize_weight; the floor
counts one byte per projection weight (bench/geometries.py decode_bytes projection_bytes=1).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from batchgen.kernels.fp8.quant import quantize_weight
from batchgen.quant.modules import Fp8Experts, Fp8Linear

WEIGHTS = ("bf16", "fp8", "fp8-channel")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = 128


def quantization_config(weights: str) -> dict:
    """The config.json quantization_config of a `weights` checkpoint (its format's own keys)."""
    if weights == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
    if weights == "fp8-channel":
        scheme = {"num_bits": 8, "type": "float", "symmetric": True}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"],
                                              "weights": {**scheme, "strategy": "channel", "dynamic": False},
                                              "input_activations": {**scheme, "strategy": "token", "dynamic": True}}}}
    raise ValueError(f"--weights {weights!r}: one of {', '.join(WEIGHTS)}")


def build_fp8_model(config, weights: str, device: str = "cuda") -> torch.nn.Module:
    """A random model of `config` whose layers' projections are Fp8Linear (bf16 everything else), seed 0. Peak
    memory: the FP8 model plus one bf16 projection."""
    from transformers import AutoModelForCausalLM

    from batchgen.quant.loader import parameters_on_meta

    moe = bool(getattr(config.get_text_config(), "num_experts", None) or getattr(config, "num_local_experts", None))
    if moe and weights != "fp8":
        raise ValueError(f"--weights {weights}: FP8 mixture-of-experts geometries are built block-wise (--weights fp8)")
    quantization_config(weights)
    group = None if weights == "fp8-channel" else BLOCK
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator(device).manual_seed(0)
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in PROJECTIONS and isinstance(module, torch.nn.Linear):
            fp8 = Fp8Linear(module.in_features, module.out_features, module.bias is not None, group or 1, group,
                            True, device=device)
            w = torch.empty(module.out_features, module.in_features, device=device, dtype=torch.bfloat16)
            fp8.weight.data, fp8.weight_scale.data = quantize_weight(w.normal_(0, 0.02, generator=gen), group, group)
            if fp8.bias is not None:
                fp8.bias.data.zero_()
            model.set_submodule(name, fp8)
    for name, module in list(model.named_modules()):
        if name.endswith(".experts") and getattr(module, "gate_up_proj", None) is not None:
            model.set_submodule(name, _random_fp8_experts(module, config, device, gen))
    for name, param in list(model.named_parameters()):
        if param.is_meta:
            owner, _, leaf = name.rpartition(".")
            value = torch.empty(param.shape, dtype=param.dtype, device=device)
            value = value.fill_(1.0) if "norm" in name else value.normal_(0, 0.02, generator=gen)
            model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    model.config.quantization_config = quantization_config(weights)  # as loaded: the floor counts 1 byte a weight
    return model.to(device).eval()


def _random_fp8_experts(experts: torch.nn.Module, config, device: str, gen: torch.Generator) -> Fp8Experts:
    """A layer's experts as Fp8Experts, normal(0, 0.02) weights quantised in 128 x 128 blocks: every expert's
    rows in one quantisation (2 I and H are multiples of 128 at the real geometries: no block spans experts)."""
    num_experts, two_inter, hidden = experts.gate_up_proj.shape
    activation = getattr(config.get_text_config(), "hidden_act", "silu")
    fp8 = Fp8Experts(num_experts, hidden, two_inter // 2, BLOCK, BLOCK, True, None, activation, device)
    for weight, scale in ((fp8.gate_up_proj, fp8.gate_up_proj_scale), (fp8.down_proj, fp8.down_proj_scale)):
        e, n, k = weight.shape
        assert n % BLOCK == 0, f"expert rows {n} not a multiple of {BLOCK}"
        w = torch.empty(e * n, k, device=device, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
        q, s = quantize_weight(w, BLOCK, BLOCK)
        weight.data, scale.data = q.view(e, n, k), s.view(e, n // BLOCK, -1)
    return fp8


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fp8Experts' 3-D tensors as checkpoints store experts: per expert, gate_proj / up_proj / down_proj weights and
    their weight_scale (renamed to the format's scale key with the Fp8Linears'; quant/experts.py reads them)."""
    out = {}
    for key, value in state.items():
        owner, _, leaf = key.rpartition(".")
        if not owner.endswith(".experts") or leaf not in ("gate_up_proj", "gate_up_proj_scale", "down_proj",
                                                          "down_proj_scale"):
            out[key] = value
            continue
        suffix = "weight_scale" if leaf.endswith("_scale") else "weight"
        for e in range(value.shape[0]):
            if leaf.startswith("gate_up"):
                rows = value.shape[1] // 2
                out[f"{owner}.{e}.gate_proj.{suffix}"] = value[e, :rows]
                out[f"{owner}.{e}.up_proj.{suffix}"] = value[e, rows:]
            else:
                out[f"{owner}.{e}.down_proj.{suffix}"] = value[e]
    return out


def save_fp8_checkpoint(model: torch.nn.Module, path: Path, weights: str, shard_bytes: int = 5 << 30) -> None:
    """Write `model` (from build_fp8_model) as a `weights` checkpoint: config.json with its quantization_config,
    safetensors shards of at most ~shard_bytes with an index, scales under the format's name."""
    from safetensors.torch import save_file

    scale_key = "weight_scale_inv" if weights == "fp8" else "weight_scale"
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    (path / "config.json").write_text(json.dumps(config, indent=1))
    state = {k.replace(".weight_scale", f".{scale_key}"): v
             for k, v in _per_expert(model.state_dict()).items()}
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    shards, current, size = [], {}, 0
    for key, tensor in state.items():
        if current and size + tensor.numel() * tensor.element_size() > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensor
        size += tensor.numel() * tensor.element_size()
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in shard.items()}, str(path / name),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

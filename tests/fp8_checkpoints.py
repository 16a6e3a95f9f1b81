"""Small FP8 checkpoints for the tests, written as each format defines them (no download), quantised by the
libraries' own quantisers: transformers' FineGrainedFP8 `Fp8Quantize` op (block-wise, what
`FineGrainedFP8Config` saves) and transformers' compressed-tensors `quantize_fp8_per_row` (per channel, as
llm-compressor's FP8_DYNAMIC and fbgemm write it). Neither quantiser runs on load without a GPU, so the
checkpoint is the tiny model's state dict with the projections replaced by (fp8 weight, scale) pairs, plus a
config.json holding the format's quantization_config.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
               "c_fc", "c_proj", "w1", "w2", "w3")  # Phi3 checkpoint-fused, Starcoder2 MLP, Mixtral's experts
FP8_MAX = 448.0


def exact_activations(m: int, k: int, group: int) -> torch.Tensor:
    """[m, k] fp32 activations that per-token, per-`group` FP8 quantisation represents exactly: FP8 values (each
    group's first at the format's max 448, so its scale is a power of two) times a power of two per group. The
    kernels' quantise-and-GEMM then equals the W8A8 reference to fp32 rounding."""
    from batchgen.kernels.fp8.quant import FP8_DTYPE

    q = torch.randn(m, k).mul(100).clamp(-440, 440).to(FP8_DTYPE).float()
    groups = -(-k // group)
    q[:, ::group] = 448.0
    return q * (2.0 ** torch.randint(-12, -4, (m, groups)).float()).repeat_interleave(group, 1)[:, :k]


def _is_projection(key: str) -> bool:
    return key.endswith(".weight") and key.split(".")[-2] in PROJECTIONS


def _block_quantize(block: tuple[int, int]):
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    config = FineGrainedFP8Config(weight_block_size=list(block))
    op = FineGrainedFP8HfQuantizer(config).get_quantize_ops()
    return config.to_dict(), lambda key, w: op._quantize_one(key, w)


def _channel_quantize(per_tensor: bool):
    from transformers.integrations.compressed_tensors import quantize_fp8_per_row

    def quantize(key: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        if per_tensor:  # one scale for the whole tensor: amax / 448
            scale = (w.abs().amax().float() / FP8_MAX).reshape(1)
            return {key: (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn),
                    key.removesuffix("weight") + "weight_scale": scale}
        q, scale = quantize_fp8_per_row(w)  # [N, K] fp8, [N]
        return {key: q, key.removesuffix("weight") + "weight_scale": scale.reshape(-1, 1)}

    return quantize


def compressed_tensors_config(strategy: str, dynamic_activations: bool = True) -> dict:
    """compressed-tensors' quantization_config for FP8 weights with `strategy` (tensor | channel) and dynamic
    per-token FP8 activations, as llm-compressor writes it."""
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True} \
        if dynamic_activations else None
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "output_activations": None,
                                          "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                      "dynamic": False, "symmetric": True, "observer": "minmax"}}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def save_fp8_checkpoint(model, tokenizer, folder: Path, fmt: str) -> Path:
    """Save `model` (a tiny fp32 transformers model) as an FP8 checkpoint of format `fmt`: "block" (FineGrained
    fp8, 32x32 blocks: tiny dims are multiples of 32, and transformers' quantiser leaves partial blocks bf16),
    "block128" (the same with real checkpoints' 128x128 blocks: dims multiples of 128), "channel" / "tensor"
    (compressed-tensors), "fbgemm" (per channel)."""
    if fmt in ("block", "block128"):
        qconfig, quantize = _block_quantize((32, 32) if fmt == "block" else (128, 128))
    elif fmt in ("channel", "tensor"):
        qconfig, quantize = compressed_tensors_config(fmt), _channel_quantize(fmt == "tensor")
    elif fmt == "fbgemm":
        qconfig = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
        quantize = _channel_quantize(False)
    else:
        raise ValueError(fmt)
    state = {}
    for key, value in _checkpoint_tensors(model).items():
        state.update(quantize(key, value.detach()) if _is_projection(key) else {key: value.detach()})
    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    config.quantization_config = qconfig
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def _checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of `model` holds: its state dict, but for mixture-of-experts models what
    save_pretrained writes (each expert's 2-D projections under the checkpoint's own names, e.g. Mixtral's
    block_sparse_moe.experts.<e>.w1, as real checkpoints store them; transformers 5.x models hold 3-D experts)."""
    if not any("experts" in name for name, _ in model.named_modules()):
        return model.state_dict()
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tensors = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            tensors.update(load_file(str(path)))
    return tensors


def dequantized_copy(model, folder: Path):
    """`model` with every projection replaced by the checkpoint's fp8 weight times its scales, in fp32 (the
    formats' definition, value = fp8 * scale; for formats transformers cannot load without a GPU package)."""
    state = load_file(str(folder / "model.safetensors"))
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for key, param in ref.named_parameters():
            if not _is_projection(key):
                continue
            scale = state.get(key + "_scale_inv", state.get(key.removesuffix("weight") + "weight_scale")).float()
            w = state[key].float()
            if scale.dim() == 2 and scale.shape[1] > 1:  # blocks
                bn, bk = -(-w.shape[0] // scale.shape[0]), -(-w.shape[1] // scale.shape[1])
                scale = scale.repeat_interleave(bn, 0)[:w.shape[0]].repeat_interleave(bk, 1)[:, :w.shape[1]]
            param.copy_(w * scale.reshape(-1, 1) if scale.dim() < 2 or scale.shape[1] == 1 else w * scale)
    return ref

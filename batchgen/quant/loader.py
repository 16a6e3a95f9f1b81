"""Loading an FP8 checkpoint (quant/scheme.py) with its projections kept in FP8: batchgen's own loader, not
transformers' quantizers, whose FP8 layers (a) dequantise on a machine without a GPU, (b) call a kernel from the
`kernels` package that the GPU image lacks, so CUDA-graph capture fails (measured on the H200), (c) need the
`compressed_tensors` / `fbgemm_gpu` packages for those formats.

How: the model is built from its config (quantization_config removed) with its parameters on the meta device
(buffers real: the rotary tables), every Linear whose `.weight` the checkpoint stores in float8_e4m3fn is replaced
by an Fp8Linear, then each safetensors tensor is read straight to the target device and assigned (fp8 weights and
their fp32 scales as they are, per-tensor scales expanded per channel; everything else cast to the model dtype).
The checkpoint's names must be the model's own (true of Llama, Mistral, Qwen2/3, Gemma, Phi3 ... in transformers 5),
but for mixture-of-experts layers: their per-expert tensors go into the model's 3-D experts, FP8 ones kept FP8
(fp8_experts.py). A tensor the model lacks, or a parameter the checkpoint lacks, is an error naming them. Peak
memory: the checkpoint's bytes on the device, one tensor at a time on the host.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch

from batchgen.errors import JobError
from batchgen.quant.modules import Fp8Linear
from batchgen.quant.scheme import Fp8Scheme, UnsupportedFp8, parse
from batchgen.quant.experts import EXPERT_KEY, ExpertAssembler, model_key

_FP8_DTYPE_NAMES = {"F8_E4M3"}  # safetensors' name for float8_e4m3fn
# tensors a checkpoint may carry that this loader reads past: static activation scales (activations are quantised
# dynamically), zero points of symmetric schemes, and rotary tables older checkpoints saved
_SKIPPED_SUFFIXES = (".input_scale", ".activation_scale", ".weight_zero_point", ".input_zero_point",
                     "rotary_emb.inv_freq")


def fp8_scheme_or_error(config, path: str) -> Fp8Scheme:
    """The checkpoint's Fp8Scheme, or a JobError naming model.path and why it cannot run."""
    try:
        return parse(config)
    except UnsupportedFp8 as e:
        raise JobError(f"model.path {path!r}: cannot run this FP8 checkpoint: {e}") from None


def check_fp8_checkpoint(config, path: str) -> Fp8Scheme | None:
    """The FP8 scheme of an FP8 checkpoint's config, None for other models; a scheme batchgen cannot run is a
    JobError naming model.path, from the config alone (run and validate call it before any weight loads)."""
    from batchgen.quant.scheme import is_fp8

    return fp8_scheme_or_error(config, path) if is_fp8(config) else None


def load_fp8_model(source: str, config, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model of the FP8 checkpoint in folder (or cached hub repo) `source`, FP8 projections as Fp8Linear, on
    `device`, eval mode. Errors are JobErrors naming model.path."""
    from transformers import AutoModelForCausalLM

    scheme = fp8_scheme_or_error(config, source)
    files = _safetensors_files(source)
    dtypes = _tensor_dtypes(files)
    bad = [k for k, d in dtypes.items() if d.startswith("F8_") and d not in _FP8_DTYPE_NAMES]
    if bad:
        raise JobError(f"model.path {source!r}: tensor {bad[0]} is {dtypes[bad[0]]}; batchgen runs float8_e4m3fn")
    fp8_weights = [model_key(k) for k, d in dtypes.items() if d in _FP8_DTYPE_NAMES and k.endswith(".weight")]
    fp8_experts = {m["owner"] for m in map(EXPERT_KEY.match, fp8_weights) if m is not None}  # 3-D FP8 experts
    fp8_modules = sorted(k.removesuffix(".weight") for k in fp8_weights if not EXPERT_KEY.match(k))  # Fp8Linears
    plain = copy.deepcopy(config)
    del plain.quantization_config
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(plain, dtype=dtype)
    model.config.quantization_config = config.quantization_config  # kept: the output fingerprint records it
    for name in fp8_modules:
        _replace_linear(model, name, scheme, dtype, source)
    experts = ExpertAssembler(model, scheme, fp8_experts, device, dtype, source)
    _assign_tensors(model, files, set(fp8_modules), experts, scheme, dtype, device, source)
    experts.finish()
    if any(p.is_meta for p in model.parameters()) and getattr(plain.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise JobError(f"model.path {source!r}: the checkpoint lacks {len(missing)} of the model's tensors "
                       f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})")
    with contextlib.suppress(OSError):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(source)
    return model.to(device).eval()


@contextlib.contextmanager
def parameters_on_meta():
    """Parameters created inside are put on the meta device (no memory, no init), buffers stay real (the rotary
    module's tables, computed at construction). Hazard: patches nn.Module.register_parameter while open."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=False)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def _safetensors_files(source: str) -> list[Path]:
    folder = Path(source)
    if not folder.is_dir():  # a hub id (model_source checked the hub): the cached snapshot's files
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(source, allow_patterns=["*.safetensors", "*.json"]))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise JobError(f"model.path {source!r}: an FP8 checkpoint needs safetensors files; none in {folder}")
    return files


def _tensor_dtypes(files: list[Path]) -> dict[str, str]:
    """Every tensor's safetensors dtype name (F8_E4M3, BF16, F32 ...), from the file headers only."""
    from safetensors import safe_open

    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            out.update({key: f.get_slice(key).get_dtype() for key in f.keys()})
    return out


def _replace_linear(model: torch.nn.Module, name: str, scheme: Fp8Scheme, dtype: torch.dtype, source: str) -> None:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if not isinstance(module, torch.nn.Linear):
        raise JobError(f"model.path {source!r}: FP8 tensor {name}.weight is not the weight of a Linear layer of "
                       f"{type(model).__name__} ({type(module).__name__ if module is not None else 'no such module'}); "
                       f"only FP8 linear projections are built")
    fp8 = Fp8Linear(module.in_features, module.out_features, module.bias is not None, scheme.group_n, scheme.group_k,
                    scheme.act_quant, scheme.scale_ub, dtype, device="meta")
    model.set_submodule(name, fp8)


def _assign_tensors(model: torch.nn.Module, files: list[Path], fp8_modules: set[str], experts: ExpertAssembler,
                    scheme: Fp8Scheme, dtype: torch.dtype, device: torch.device, source: str) -> None:
    """Each checkpoint tensor into its module (experts' into their 3-D slices), read to `device` one at a time."""
    from safetensors import safe_open

    unexpected = []
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for stored in f.keys():
                key = model_key(stored)
                if EXPERT_KEY.match(key):
                    experts.put(key, f.get_tensor(stored))
                    continue
                owner, _, leaf = key.rpartition(".")
                if owner in fp8_modules and leaf == scheme.scale_key:
                    scale = _canonical_scale(f.get_tensor(stored), model.get_submodule(owner), key, source)
                    _set(model, owner, "weight_scale", scale)
                elif owner in fp8_modules and leaf == "weight":
                    _set(model, owner, "weight", f.get_tensor(stored))
                elif key.endswith(_SKIPPED_SUFFIXES):
                    continue
                elif not _set(model, owner, leaf, f.get_tensor(stored), dtype):
                    unexpected.append(key)
    if unexpected:
        raise JobError(f"model.path {source!r}: {len(unexpected)} checkpoint tensors are not {type(model).__name__}'s "
                       f"({', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''})")


def _canonical_scale(scale: torch.Tensor, module: Fp8Linear, key: str, source: str) -> torch.Tensor:
    """An fp32 scale of Fp8Linear's layout: a per-tensor scale expanded to [N, 1]; per-channel [N] or [N, 1] as
    [N, 1]; block scales checked against [ceil(N / group_n), ceil(K / group_k)]."""
    scale = scale.float()
    expected = tuple(module.weight_scale.shape)
    if module.group_k is None and scale.numel() == 1:
        return scale.reshape(1, 1).expand(module.out_features, 1).contiguous()
    if scale.numel() == expected[0] * expected[1]:
        return scale.reshape(expected).contiguous()
    raise JobError(f"model.path {source!r}: {key} has shape {tuple(scale.shape)}; the checkpoint's "
                   f"quantization_config implies {expected} for a weight of {module.out_features}x{module.in_features}")


def _set(model: torch.nn.Module, owner: str, leaf: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Assign a loaded tensor to parameter or buffer `owner.leaf` (floating tensors cast to `dtype` when given);
    False when the model has no such tensor."""
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    if leaf in module._parameters and module._parameters[leaf] is not None:
        module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
        return True
    if leaf in module._buffers:
        module._buffers[leaf] = tensor
        return True
    return False

"""Mixture-of-experts tensors of an FP8 checkpoint into the model batchgen's FP8 loader builds (loader.py).

Checkpoints store each expert's projections as 2-D tensors (`<layer>.mlp.experts.<e>.gate_proj.weight`, its
`weight_scale_inv`; Mixtral: `<layer>.block_sparse_moe.experts.<e>.w1` / `w3` / `w2` for gate / up / down, and its
router under `block_sparse_moe.gate`), while transformers 5.x's models hold a layer's experts as 3-D parameters
(`mlp.experts.gate_up_proj` [E, 2 I, H]: each expert's gate rows then its up rows; `down_proj` [E, H, I]).
`ExpertAssembler` writes each checkpoint tensor into its slice of the 3-D ones, on the target device, one tensor
at a time: FP8 experts into a quant/modules.py Fp8Experts that replaces the layer's experts module (weights in
float8_e4m3fn, block scales [E, 2 I / group_n, H / group_k] and [E, H / group_n, I / group_k]); float experts (an
FP8 checkpoint that left them unquantised) into the module's own parameters. Every slice must be written once:
`finish` names the first one missing.
"""

from __future__ import annotations

import re

import torch

from batchgen.errors import JobError
from batchgen.kernels.fp8.quant import FP8_DTYPE
from batchgen.quant.modules import Fp8Experts
from batchgen.quant.scheme import Fp8Scheme

# <owner: the layer's experts module>.<expert index>.<projection>.<tensor>
EXPERT_KEY = re.compile(r"^(?P<owner>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)"
                        r"\.(?P<leaf>weight|weight_scale_inv|weight_scale)$")
PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# checkpoint module names -> transformers 5.x's (Mixtral's sparse block became `mlp`)
RENAMES = ((".block_sparse_moe.", ".mlp."),)


def model_key(key: str) -> str:
    """A checkpoint tensor's name as the transformers 5.x model names it."""
    for old, new in RENAMES:
        key = key.replace(old, new)
    return key


class ExpertAssembler:
    """Writes per-expert checkpoint tensors into `model`'s 3-D experts (module docstring)."""

    def __init__(self, model: torch.nn.Module, scheme: Fp8Scheme, fp8_owners: set[str], device: torch.device,
                 dtype: torch.dtype, source: str) -> None:
        self.model, self.scheme, self.fp8_owners = model, scheme, fp8_owners
        self.device, self.dtype, self.source = device, dtype, source
        self.written: dict[str, set[tuple[int, str, str]]] = {}  # owner -> (expert, part, weight | scale)
        self.num_experts: dict[str, int] = {}

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Write checkpoint tensor `key` (a model_key name) into its experts' slice; False when it is not an expert
        tensor."""
        match = EXPERT_KEY.match(key)
        if match is None:
            return False
        owner, expert, part = match["owner"], int(match["expert"]), PART[match["proj"]]
        kind = "weight" if match["leaf"] == "weight" else "scale"
        fp8 = owner in self.fp8_owners
        if kind == "scale" and not fp8:
            raise JobError(f"model.path {self.source!r}: {key}: a scale for experts whose weights are not FP8")
        if kind == "weight" and fp8 != (tensor.dtype == FP8_DTYPE):
            raise JobError(f"model.path {self.source!r}: {key} is {tensor.dtype}; the layer's other experts are "
                           f"{'FP8' if fp8 else 'not FP8'}: one layer's experts must share their format")
        module = self._module(owner)
        if expert >= self.num_experts[owner]:
            raise JobError(f"model.path {self.source!r}: {key}: expert {expert} of a layer with "
                           f"{self.num_experts[owner]} experts")
        target = self._target(module, part, kind)[expert]
        rows = target.shape[0] // 2
        piece = target if part == "down" else target[:rows] if part == "gate" else target[rows:]
        if tuple(tensor.shape) != tuple(piece.shape):
            raise JobError(f"model.path {self.source!r}: {key} has shape {tuple(tensor.shape)}; the model's experts "
                           f"take {tuple(piece.shape)}")
        with torch.no_grad():
            piece.copy_(tensor if kind == "scale" or fp8 else tensor.to(self.dtype))
        self.written[owner].add((expert, part, kind))
        return True

    def finish(self) -> None:
        """Raises JobError naming the first expert slice the checkpoint did not hold."""
        for owner, done in self.written.items():
            kinds = ("weight", "scale") if owner in self.fp8_owners else ("weight",)
            for expert in range(self.num_experts[owner]):
                for part in ("gate", "up", "down"):
                    for kind in kinds:
                        if (expert, part, kind) not in done:
                            raise JobError(f"model.path {self.source!r}: the checkpoint lacks expert {expert}'s "
                                           f"{part} {kind} of {owner}")

    def _module(self, owner: str) -> torch.nn.Module:
        """The owner's experts module: on first use an Fp8Experts in place of transformers' (FP8 experts), or the
        module itself with its 3-D parameters allocated on the device (float experts)."""
        try:
            module = self.model.get_submodule(owner)
        except AttributeError:
            raise JobError(f"model.path {self.source!r}: {owner} is not a module of "
                           f"{type(self.model).__name__}") from None
        if owner in self.written:
            return module
        self.written[owner] = set()
        num_experts, two_inter, hidden = module.gate_up_proj.shape
        self.num_experts[owner] = num_experts
        if owner in self.fp8_owners:
            s = self.scheme
            activation = getattr(self.model.config.get_text_config(), "hidden_act", "silu")
            try:
                module = Fp8Experts(num_experts, hidden, two_inter // 2, s.group_n, s.group_k, s.act_quant, s.scale_ub,
                                    activation, self.device)
            except ValueError as e:
                raise JobError(f"model.path {self.source!r}: {owner}: {e}") from None
            self.model.set_submodule(owner, module)
        else:
            for name in ("gate_up_proj", "down_proj"):
                shape = getattr(module, name).shape
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(shape, dtype=self.dtype, device=self.device), requires_grad=False)
        return module

    @staticmethod
    def _target(module: torch.nn.Module, part: str, kind: str) -> torch.Tensor:
        name = "gate_up_proj" if part in ("gate", "up") else "down_proj"
        return getattr(module, name + ("_scale" if kind == "scale" else ""))

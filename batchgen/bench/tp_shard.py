"""A random model's tensor-parallel shard, built for rank r of N directly on that rank's device: the full weights
never exist anywhere (a 70B bf16 model, 141 GB, fits neither one GPU nor the two-GPU machine's disk).

How: the model is built with its parameters on the meta device (buffers real: the rotary tables), sharded there by
`models/shard.shard_model_` (slices, copies and padding of meta tensors cost nothing), and only then is each
parameter allocated on the device and filled: normal(0, 0.02) like transformers' init, norms 1.0. The model carries
shard_model_'s mark, so `distributed.for_engine` takes it as this rank's shard and does not split it again.

Seeds. The parameters every rank holds whole (embedding, norms) must be equal on every rank: the ranks' residual
streams stay identical only if they start from the same embedding rows and scale by the same norms. So each
parameter's values come from its own generator, seeded by its name (whole parameters) or by its name and the rank
(shards): the same on every run, independent of the order parameters are filled in, and of which ranks hold a
parameter (rank 0 alone keeps a row-parallel bias).
"""

from __future__ import annotations

import zlib

import torch

from batchgen.models.shard import shard_model_
from batchgen.quant.loader import parameters_on_meta

INIT_STD = 0.02  # transformers' initializer_range default


def parameter_seed(seed: int, name: str, rank: int | None) -> int:
    """The generator seed of parameter `name`: of `name` alone for a parameter every rank holds whole (rank None),
    of `name` and `rank` for a rank's shard."""
    return zlib.crc32(f"{seed}/{name}/{'whole' if rank is None else rank}".encode())


def build_random_shard(config, rank: int, size: int, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                       seed: int = 0) -> torch.nn.Module:
    """Rank `rank` of `size`'s shard of a random model of transformers config `config`, on `device`, eval mode.
    Peak device memory: the shard (parameters are allocated one at a time, each at its local shape)."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # named_parameters lists a tied LM head once (as the embedding): after sharding it is a parameter of its own
    whole_shapes = {name: param.shape for name, param in model.named_parameters()}
    shard_model_(model, rank, size)
    device = torch.device(device)
    for name, param in list(model.named_parameters()):
        assert param.is_meta, f"{name} was materialised before its shard was filled"
        # shard_model_ divides one dimension of every tensor it splits by size (heads, MLP columns, ceil of the
        # vocabulary), so for size >= 2 an unchanged shape means a tensor every rank holds whole (size 1: all are)
        whole = whole_shapes.get(name) == param.shape
        gen = torch.Generator(device).manual_seed(parameter_seed(seed, name, None if whole else rank))
        value = torch.empty(param.shape, dtype=param.dtype, device=device)
        # the last rank's zero-padding rows of the LM head are filled too: their logits are trimmed after the
        # gather (shard.VocabParallelHead), never sampled
        value = value.fill_(1.0) if "norm" in name else value.normal_(0.0, INIT_STD, generator=gen)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    return model.to(device).eval()  # moves the buffers; the parameters are there already

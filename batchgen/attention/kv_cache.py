"""KVCache: the paged K/V tensors of all layers, and how many blocks fit in a memory budget.

KVGeometry is the one reading of a model config's attention shape (layers, query heads, KV heads, head
dim): the cache, the fused decoders and `batchgen validate` all take it from here.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import torch

from batchgen.kernels.attention.reference import KV_FP8


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> KVGeometry:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        return cls(num_layers=text.num_hidden_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


class KVCacheUnsupported(ValueError):
    """engine.kv_cache_dtype names a type this device's kernels cannot run (the job runner reports it by key)."""


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The K/V cache's element type (EngineConfig.kv_cache_dtype: "auto" = the model's, "fp8"). An fp8 cache on a
    GPU before compute capability 8.9 is refused: Triton builds no fp8 (e4m3) kernel there."""
    if kv_cache_dtype != "fp8":
        return model_dtype
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is not None and capability < (8, 9):
        major, minor = capability
        raise KVCacheUnsupported(f"engine.kv_cache_dtype: fp8 needs a GPU of compute capability 8.9 or later (Ada, "
                                 f"Hopper, Blackwell); {torch.cuda.get_device_name(device)} is {major}.{minor}. "
                                 f"Leave engine.kv_cache_dtype at auto")
    return KV_FP8


# cache_id -> cache, see KVCache.cache_id. Weak: the registry never keeps a cache (or its memory) alive; a cache
# is gone from it once its engine closes it or drops the last reference.
_CACHES_BY_ID: weakref.WeakValueDictionary[int, KVCache] = weakref.WeakValueDictionary()


class KVCache:
    """K and V for every layer: `k_cache`, `v_cache` of shape [num_layers, num_blocks + 1, block_size, Hkv, D].

    Blocks 0..num_blocks-1 belong to the BlockManager; the extra last block is a write sink for the padding
    rows of CUDA-graph buckets (`trash_slot`), never read by a real sequence."""

    def __init__(self, geometry: KVGeometry, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.trash_slot = num_blocks * block_size
        shape = (geometry.num_layers, num_blocks + 1, block_size, geometry.num_kv_heads, geometry.head_dim)
        need = (num_blocks + 1) * geometry.bytes_per_block(block_size, dtype)  # K and V
        available = _available_host_bytes() if device.type == "cpu" else None
        if available is not None and need > available:
            raise MemoryError(f"the KV cache needs {need / 2**30:.1f} GiB ({num_blocks} blocks of {block_size} "
                              f"tokens) but {available / 2**30:.1f} GiB of memory is available")
        try:
            self.k_cache = torch.zeros(shape, dtype=dtype, device=device)  # [L, N + 1, bs, Hkv, D]
            self.v_cache = torch.zeros(shape, dtype=dtype, device=device)  # [L, N + 1, bs, Hkv, D]
        except RuntimeError as e:  # the CPU allocator's failure is a plain RuntimeError
            if "alloc" not in str(e).lower() or isinstance(e, torch.OutOfMemoryError):
                raise
            raise MemoryError(f"the KV cache ({need / 2**30:.1f} GiB) could not be allocated: "
                              f"{str(e).splitlines()[0][:200]}") from None
        # Compiled graphs reach the cache through this id (an op argument), never as a graph input: a graph
        # input that an op mutates would be functionalized, i.e. copied whole, by torch.compile.
        self.cache_id = id(self)
        _CACHES_BY_ID[self.cache_id] = self

    @staticmethod
    def lookup(cache_id: int) -> KVCache:
        cache = _CACHES_BY_ID.get(cache_id)
        if cache is None or cache.k_cache is None:
            raise RuntimeError(f"KV cache {cache_id} was released (its engine is closed)")
        return cache

    def release(self) -> None:
        """Give the K/V memory back now (the engine's close); the cache is unusable after."""
        _CACHES_BY_ID.pop(self.cache_id, None)
        self.k_cache = self.v_cache = None

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache[layer_idx], self.v_cache[layer_idx]

    @property
    def num_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()


def _available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def plan_num_blocks(geometry: KVGeometry, block_size: int, dtype: torch.dtype, device: torch.device,
                    memory_utilization: float, reserve_bytes: int, cpu_max_bytes: int = 2 << 30) -> int:
    """Blocks that fit the budget: on CUDA, `memory_utilization` of total memory minus what is already used
    and `reserve_bytes` for activations; on CPU, at most `cpu_max_bytes`."""
    per_block = geometry.bytes_per_block(block_size, dtype)
    held = ""
    if device.type == "cuda":
        # an Engine dropped without close() holds its cache until the cycle collector runs, and torch's allocator
        # keeps freed blocks reserved: both would count as used here, and a second engine in the process (a
        # notebook, a test session) got no cache at all
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * memory_utilization) - (total - free) - reserve_bytes
        mine = torch.cuda.memory_allocated(device)
        held = (f"; this process's tensors hold {mine / 2**30:.2f} GiB of it, the model's weights included (more "
                f"than they need: an Engine not closed?)")
    else:
        budget = cpu_max_bytes
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise MemoryError(
            f"no memory left for the KV cache on {device} (budget {budget / 2**30:.2f} GiB, one block needs "
            f"{per_block / 2**20:.1f} MiB{held}): raise engine.gpu_memory_utilization or lower "
            f"engine.max_num_batched_tokens"
        )
    return int(num_blocks)

"""EngineConfig: the engine's knobs. None of them changes what is generated, only how fast."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 8192  # tokens in one step (prefill chunks + decodes)
    block_size: int = 16  # tokens per KV block
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights + KV cache + activations
    num_kv_blocks: int | None = None  # fixed cache size; None sizes it from memory
    cpu_kv_cache_bytes: int = 1 << 30  # KV cache budget on CPU when num_kv_blocks is None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (CUDA only; ignored on CPU)
    fused_decoder: bool = True  # decode steps of Llama-family models run batchgen's fused forward
    compile_model: bool = False  # torch.compile the graphed decode forward (fuses norms, rotary, activations)
    graph_blas_library: str | None = "cublaslt"  # GEMM back end captured in decode graphs; None: torch's default
    async_pipeline: bool = False  # prepare step N+1 on the host while the device runs step N

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"engine.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.graph_blas_library not in (None, "cublas", "cublaslt"):
            raise ValueError(f"graph_blas_library must be 'cublas', 'cublaslt' or None, got {self.graph_blas_library!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"engine.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")

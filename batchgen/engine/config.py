"""EngineConfig: the engine's knobs. None of them changes what is generated, only how fast, except
`deterministic`, which picks other numerics (batch-invariant kernels), and `kv_cache_dtype: fp8`, which rounds
every cached key and value to fp8: both are part of a job's fingerprint.

The one definition of these settings: the job file's `engine:` section is this model (YAML names `async` for
`async_pipeline`), so a new knob is a field here plus its use.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, WithJsonSchema, WrapValidator, model_validator

from batchgen.engine.sizing import MAX_AUTO_BATCHED_TOKENS, MAX_AUTO_SEQS

PositiveInt = Annotated[int, Field(gt=0)]


class Auto(int):
    """A size the engine chooses at start-up (`auto`, engine/sizing.py). As an int it is the most the engine may
    choose, so that a reader needing a bound before the engine exists (how many rows a job renders ahead) gets one;
    `isinstance(value, Auto)` tells it from a number the user set. Hazard: the engine's choice is
    `Engine.max_num_seqs` / `Engine.max_num_batched_tokens`, not this value. Written back as "auto"."""

    def __repr__(self) -> str:
        return "'auto'"

    def __str__(self) -> str:
        return "auto"

    def __format__(self, spec: str) -> str:
        return "auto" if not spec else int.__format__(self, spec)


def _auto_or_positive(cap: int):
    def validate(value, handler):
        if isinstance(value, Auto) or (isinstance(value, str) and value.strip().lower() == "auto"):
            return Auto(cap)
        if isinstance(value, str) and not value.strip().lstrip("+").isdigit():
            raise ValueError("expected a positive integer or auto")
        return handler(value)

    return Annotated[int, Field(gt=0), WrapValidator(validate),
                     PlainSerializer(lambda v: "auto" if isinstance(v, Auto) else int(v)),
                     WithJsonSchema({"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"const": "auto"}],
                                     "default": "auto"})]


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # sequences in one step; auto: what the K/V cache holds to the end for the queued prompts' lengths, up to 1,024
    # on CUDA (256 on CPU), never below 256 where the device allows it (engine/sizing.py)
    max_num_seqs: _auto_or_positive(MAX_AUTO_SEQS) = Auto(MAX_AUTO_SEQS)
    # tokens in one step (prefill chunks + decodes); auto: 16 a sequence, 8,192 to 16,384
    max_num_batched_tokens: _auto_or_positive(MAX_AUTO_BATCHED_TOKENS) = Auto(MAX_AUTO_BATCHED_TOKENS)
    # waiting prompts start only once this many sequence slots are free (or nothing runs, or fewer wait): k prompts
    # in one prefill step instead of one per finished sequence (engine/scheduler.py); 1: as soon as a slot frees;
    # above max_num_seqs it acts as max_num_seqs (whole waves: a batch refills only once it has emptied)
    admission_group: PositiveInt = 1
    block_size: PositiveInt = 16  # tokens per KV block
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9  # share of GPU memory for weights + KV + activations
    num_kv_blocks: PositiveInt | None = None  # fixed cache size; None sizes it from memory
    cpu_kv_cache_bytes: PositiveInt = 1 << 30  # KV cache budget on CPU when num_kv_blocks is None
    max_model_len: PositiveInt | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (CUDA only; no effect on CPU)
    fused_decoder: bool = True  # decode steps of models with a fused decoder (models/registry.py) run it
    compile: bool = False  # torch.compile the graphed decode forward of transformers' modules (minutes of start-up)
    # GEMM back end captured in decode graphs; auto: per batch bucket, the faster for the model's GEMMs timed at
    # start-up (not shown to win end to end: bench/results/2026-12-01-penalty-compile-artefact-gpu-busy.md). engine.deterministic pins its own
    # (cuBLASLt, kernels/invariant/fixed_row_gemm.py) for every GEMM, eager and graphed: only that one or None goes with it
    graph_blas_library: Literal["auto", "cublas", "cublaslt"] | None = "cublaslt"
    # prepare step N+1 on the host while the device runs step N; auto: on where the model is on CUDA
    async_pipeline: bool | Literal["auto"] = Field("auto", alias="async")
    # ranks (processes, one GPU each on CUDA) that split every layer's heads and MLP columns and the vocabulary;
    # rank 0 schedules and samples; batchgen/distributed/. Changes the rounding (partial sums), not the contract
    tensor_parallel_size: PositiveInt = 1
    # batch-invariant kernels (models/registry.py build_deterministic): a row's tokens do not depend on the other
    # rows of its steps, max_num_seqs, max_num_batched_tokens, prefix-cache hits, preemption or the worker count
    deterministic: bool = False
    # FP8 block-scaled projections on CUDA (kernels/fp8/gemm.py): auto = gemm_path's measured choice; blockwise
    # (cuBLASLt block-scaled _scaled_mm), triton (block_scaled_matmul) or splitk (kernels/fp8/splitk.py) at every
    # batch size. Same checkpoint semantics (activations quantised per token and 128 columns) on every path
    fp8_gemm: Literal["auto", "blockwise", "triton", "splitk"] = "auto"
    # the K/V cache's element type: auto = the model's dtype; fp8 = float8_e4m3fn, one byte an element (twice the
    # blocks in the same memory, half the bytes a decode step reads), scale 1 (values past +-448 saturate); the
    # attention kernels upcast what they read. Changes the numerics: part of a job's fingerprint
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"

    @model_validator(mode="after")
    def _deterministic_needs_the_fused_decoder(self) -> EngineConfig:
        if not self.deterministic:
            return self
        tp = f"engine.tensor_parallel_size {self.tensor_parallel_size}"
        for key, conflict in (("engine.fused_decoder: false", not self.fused_decoder),
                              ("engine.compile: true", self.compile), (tp, self.tensor_parallel_size > 1)):
            if conflict:
                raise ValueError(f"engine.deterministic runs the fused decoders' batch-invariant kernels on one "
                                 f"device; {key} cannot be combined with it (its reductions depend on the batch)")
        # Its GEMMs pin their own library (kernels/invariant/fixed_row_gemm.BLAS_LIBRARY, this field's default) around every
        # call, eager and graphed alike: another value here would be silently ignored, so it is refused.
        default = type(self).model_fields["graph_blas_library"].default
        if self.graph_blas_library not in (None, default):
            raise ValueError(f"engine.deterministic runs every GEMM on {default} at a fixed row count, eager and "
                             f"graphed alike (a GEMM's bits depend on the library); engine.graph_blas_library: "
                             f"{self.graph_blas_library} cannot be combined with it (leave it at {default})")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_needs_the_fused_decoder(self) -> EngineConfig:
        if self.tensor_parallel_size > 1 and (not self.fused_decoder or self.compile):
            key = "engine.fused_decoder: false" if not self.fused_decoder else "engine.compile: true"
            raise ValueError(f"engine.tensor_parallel_size {self.tensor_parallel_size} runs the fused decoders' "
                             f"sharded layers; {key} runs transformers' modules, which are not sharded")
        return self

    def context_length(self, model_config) -> int:
        """Tokens a sequence may hold: max_model_len, else the model's max_position_embeddings."""
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        return self.max_model_len or getattr(text, "max_position_embeddings", None) or 1 << 30

    def async_on(self, device_type: str) -> bool:
        return device_type == "cuda" if self.async_pipeline == "auto" else self.async_pipeline

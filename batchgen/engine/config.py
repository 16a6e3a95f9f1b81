"""EngineConfig: the engine's knobs. None of them changes what is generated, only how fast, except
`deterministic`, which picks other numerics (batch-invariant kernels), and `kv_cache_dtype: fp8`, which rounds
every cached key and value to fp8: both are part of a job's fingerprint.

The one definition of these settings: the job file's `engine:` section is this model (YAML names `async` for
`async_pipeline`), so a new knob is a field here plus its use.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, PlainSerializer, WithJsonSchema, WrapValidator, model_validator

from batchgen.engine.sizing import MAX_AUTO_BATCHED_TOKENS, MAX_AUTO_SEQS
from batchgen.sampling_params import NoBooleanNumbers

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


class EngineConfig(NoBooleanNumbers):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # engine/sizing.py chooses the auto sizes
    max_num_seqs: _auto_or_positive(MAX_AUTO_SEQS) = Field(Auto(MAX_AUTO_SEQS), description=(
        "Sequences in one step at most. auto: what the K/V cache holds to the end for the queued prompts' "
        "lengths, up to 1,024 on CUDA (256 on CPU), never below 256 where the device allows it; the choice is "
        "printed at start-up. A number caps memory or latency."))
    max_num_batched_tokens: _auto_or_positive(MAX_AUTO_BATCHED_TOKENS) = Field(
        Auto(MAX_AUTO_BATCHED_TOKENS), description=(
        "Tokens in one step at most (prompt chunks plus one a decoding sequence). auto: 16 a sequence, between "
        "8,192 and 16,384."))
    block_size: PositiveInt = Field(16, description="Tokens per K/V cache block.")
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = Field(0.9, description=(
        "Share of the GPU's memory batchgen may use for weights, K/V cache and activations."))
    num_kv_blocks: PositiveInt | None = Field(None, description=(
        "A fixed K/V cache size in blocks; null sizes it from memory (gpu_memory_utilization, or "
        "cpu_kv_cache_bytes on CPU)."))
    cpu_kv_cache_bytes: PositiveInt = Field(1 << 30, description=(
        "Bytes of K/V cache on CPU when num_kv_blocks is null."))
    max_model_len: PositiveInt | None = Field(None, description=(
        "Tokens a sequence may hold, prompt and completion, at most the model's max_position_embeddings (a job "
        "asking for more is refused); null: that context."))
    enable_prefix_caching: bool = Field(True, description=(
        "Share the K/V blocks of a common prompt prefix between sequences (the n samples of a row always share "
        "their prompt's)."))
    cuda_graphs: bool = Field(True, description=(
        "Decode steps replay CUDA graphs, captured at start-up per batch size (CUDA only; no effect on CPU)."))
    fused_decoder: bool = Field(True, description=(
        "Run batchgen's own decoder layers for the model families that have them; false runs transformers' "
        "modules (with batchgen's attention) for every model."))
    compile: bool = Field(False, description=(
        "Run decode steps through torch.compile'd transformers' modules instead of a fused decoder; adds "
        "minutes of start-up."))
    # the measured choice: docs/guide/performance.md
    graph_blas_library: Literal["cublas", "cublaslt"] | None = Field("cublaslt", description=(
        "The BLAS library whose GEMMs the decode graphs capture; null: torch's default. engine.deterministic "
        "takes cublaslt or null only."))
    async_pipeline: bool | Literal["auto"] = Field("auto", alias="async", description=(
        "Prepare step N+1 on the host while the device runs step N. auto: on where the model is on CUDA."))
    tensor_parallel_size: PositiveInt = Field(1, description=(
        "Processes (one GPU each on CUDA) that split every layer and the vocabulary between them, for a model "
        "too big for one GPU. Changes the rounding (partial sums), not what a job means; the same as "
        "`batchgen run --tensor-parallel`."))
    deterministic: bool = Field(False, description=(
        "Batch-invariant kernels: a row's tokens do not depend on the other rows of its steps, max_num_seqs, "
        "max_num_batched_tokens, prefix-cache hits, preemption or the worker count (slower; some models and "
        "settings are refused). Part of the fingerprint."))
    fp8_gemm: Literal["auto", "blockwise", "triton", "splitk"] = Field("auto", description=(
        "FP8 checkpoints on CUDA: which GEMM runs the block-scaled projections. auto: the measured choice per "
        "shape; blockwise (cuBLASLt), triton or splitk force one path at every batch size (for comparisons). "
        "Every path computes the same thing."))
    kv_cache_dtype: Literal["auto", "fp8"] = Field("auto", description=(
        "The K/V cache's element type: auto is the model's dtype; fp8 (float8_e4m3fn, values past +-448 "
        "saturate) holds twice the blocks in the same memory. Changes the numerics: part of the fingerprint."))

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


# what batchgen passes apply_chat_template itself (messages is the template's variable for the conversation): given
# again as chat_template_kwargs they collide ("got multiple values") and every row fails; so do these two when true
# (continue_final_message contradicts the generation prompt; an assistant mask needs a tokenized result). The call's
# other arguments (padding, return_dict, ...) do nothing without tokenizing; tools, documents and chat_template are
# the template's to use.
RESERVED_CHAT_TEMPLATE_KWARGS = ("conversation", "messages", "add_generation_prompt", "tokenize")
RESERVED_WHEN_TRUE_CHAT_TEMPLATE_KWARGS = ("continue_final_message", "return_assistant_tokens_mask")


def check_chat_template_kwargs(kwargs: dict, key: str = "prompt.chat_template_kwargs") -> None:
    """ValueError naming the first of `kwargs` that would make every prompt's chat template call fail."""
    taken = [k for k, v in kwargs.items()
             if k in RESERVED_CHAT_TEMPLATE_KWARGS or (k in RESERVED_WHEN_TRUE_CHAT_TEMPLATE_KWARGS and v)]
    if taken:
        raise ValueError(f"{key}: {', '.join(map(repr, taken))} cannot be set here: batchgen renders each prompt "
                         f"with messages=the row's turns, add_generation_prompt=true and tokenize=false, so every "
                         f"row would fail; give only the template's own variables (for example enable_thinking)")

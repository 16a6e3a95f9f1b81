"""The job's schema: ModelSpec .. JobSpec, the one definition of every setting a job file may hold. Its `sampling:`
and `engine:` sections are the Python API's SamplingParams and EngineConfig themselves. Imported by sources/,
output/, prompts and job/; imports none of them.

What a job may ask is bounded (`limits:`, LimitsSpec), so a hostile or mistaken job file fails with a message
naming the key instead of exhausting the machine. Reading a job file: config/parse.py and job/job_file.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from batchgen.engine.config import EngineConfig
from batchgen.sampling_params import SamplingParams

PositiveInt = Annotated[int, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ModelSpec(_Strict):
    path: str  # local folder, hub id, or package:NAME (a Python package shipping weights)
    gguf_file: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N


class SourceSpec(_Strict):
    path: str | list[str]  # files, globs, a save_to_disk folder, or a hub dataset name
    # inferred from the path when omitted; batchgen_output: another job's output directory (chained jobs)
    type: Literal["parquet", "jsonl", "hf", "batchgen_output", "openai_batch"] | None = None
    split: str = "train"
    name: str | None = None  # hub dataset configuration
    streaming: bool = True
    key_column: str | None = None  # row identity; without it, the row's position in the source
    sampling_column: str | None = None  # a column of per-row `sampling:` overrides (JSON object); job/row_sampling.py
    limit: PositiveInt | None = None
    # Rows are dealt to workers in units of this many consecutive rows. None: sized from the source's row
    # count so that every worker gets rows (job/workers.py sized_for), 1,024 for large sources.
    worker_unit_rows: PositiveInt | None = None


class LimitsSpec(_Strict):
    """Bounds on what a job (or one of its rows) may ask. Not part of the fingerprint: raising one does not
    change a completion, only whether a row that hit it is generated.

    max_samples_per_row bounds sampling.n; with the loop's lookahead of 2 x engine.max_num_seqs prompts, the
    sequences in flight are at most 2 x max_num_seqs x max_samples_per_row. A row of an OpenAI batch file may
    ask for at most 128 (OpenAI's own limit on n); a larger body.n rejects that line.
    A template render (prompt.template) may take at most max_render_steps loop iterations and calls, build no
    string or list longer than max_prompt_chars and output at most max_prompt_chars characters; the chat template
    alike (its output; its steps are not counted). Every render (template and chat template) stops after
    render_timeout_s seconds of wall time (SIGALRM; the main thread only). A row over a limit is rejected
    (template_error / chat_template_error / prompt_too_long); a template over a limit on each of the first
    rows it renders stops the job (prompts.py FAIL_FAST_ROWS)."""

    max_samples_per_row: PositiveInt = 256
    max_render_steps: PositiveInt = 1_000_000
    max_prompt_chars: PositiveInt = 4_000_000
    render_timeout_s: Annotated[float, Field(gt=0)] = 5.0


class PromptSpec(_Strict):
    template: str | None = None  # Jinja2 over the row's columns: "Summarize: {{ text }}"
    column: str | None = None  # the prompt is this column's text
    messages_column: str | None = None  # a list of {role, content} chat messages
    system: str | None = None
    chat: bool = True  # apply the tokenizer's chat template
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    on_too_long: Literal["reject", "truncate_left", "truncate_right"] = "reject"
    max_prompt_tokens: PositiveInt | None = None  # default: model context - max_new_tokens
    # the job's `limits:`, linked by JobSpec (a PromptSpec built alone has the defaults); private so that the
    # prompt's fingerprint (its model_dump) does not change with a limit. Hazard: a PromptSpec made by
    # model_copy keeps it, one made anew does not.
    _limits: LimitsSpec = PrivateAttr(default_factory=LimitsSpec)

    @property
    def limits(self) -> LimitsSpec:
        return self._limits

    @model_validator(mode="after")
    def _one_prompt_source(self) -> PromptSpec:
        given = [k for k in ("template", "column", "messages_column") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"set exactly one of prompt.template, prompt.column, prompt.messages_column "
                             f"(got {', '.join(given) or 'none'})")
        if self.messages_column is not None and not self.chat:
            raise ValueError("prompt.messages_column needs prompt.chat: true")
        return self


class ReasoningSpec(_Strict):
    """Think markers of a reasoning model, as text (each usually one token of the vocabulary)."""

    start: Annotated[str, Field(min_length=1)] = "<think>"
    end: Annotated[str, Field(min_length=1)] = "</think>"


class OutputSpec(_Strict):
    dir: str | None = None  # None: out/<name> next to the job file (load_spec always sets it)
    rows_per_shard: PositiveInt = 1000
    commit_interval_s: Annotated[float, Field(gt=0)] = 60.0  # commit at least this often, even if a shard is short
    keep_columns: Literal["all", "none"] | list[str] = "all"
    keep_prompt: bool = False
    keep_token_ids: bool = False  # also store each completion's token ids (list<int32>; a stop token id is kept, as counted)
    report: bool = True  # when a run ends: README.md (dataset card), reports/*.png and reports/index.html
    # logprobs / reasoning
    # auto: the tokenizer's <think> / </think> tokens if it has them, else none; with markers, `completion` holds
    # the answer only, `reasoning` the think block's text, `num_reasoning_tokens` its length
    reasoning: Literal["auto", "none"] | ReasoningSpec = "none"


# structured output
class JobSampling(SamplingParams):
    """The job's `sampling:` section: SamplingParams plus what only a job can say (it names a source column)."""

    # a column holding a JSON Schema per row (JSON text): that row's response_format (type json_schema)
    response_format_column: str | None = None

    @model_validator(mode="after")
    def _column_rows_end_by_grammar(self) -> JobSampling:
        if self.response_format_column is not None and (self.min_new_tokens
                                                        or self.thinking_budget is not None):
            raise ValueError("response_format_column decides where its rows end: it cannot be combined with "
                             "min_new_tokens > 0 or thinking_budget")
        return self


class JobSpec(_Strict):
    name: str | None = None
    model: ModelSpec
    source: SourceSpec
    prompt: PromptSpec
    sampling: JobSampling = Field(default_factory=JobSampling)  # SamplingParams (sampling_params.py) + job-only
    engine: EngineConfig = Field(default_factory=EngineConfig)  # the one definition: engine/config.py
    output: OutputSpec = Field(default_factory=OutputSpec)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)

    @model_validator(mode="after")
    def _within_limits(self) -> JobSpec:
        if self.sampling.n > self.limits.max_samples_per_row:
            raise ValueError(f"'sampling.n' = {self.sampling.n}: more samples per row than "
                             f"limits.max_samples_per_row ({self.limits.max_samples_per_row}); lower sampling.n "
                             f"or raise limits.max_samples_per_row (each sample holds its own sequence)")
        self.prompt._limits = self.limits
        return self


# ---- loading ---------------------------------------------------------------------------------------

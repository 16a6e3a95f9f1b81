"""The job's schema: ModelSpec .. JobSpec, the one definition of every setting a job file may hold. Its `sampling:`
and `engine:` sections are the Python API's SamplingParams and EngineConfig themselves. Imported by sources/,
output/, prompts and job/; imports none of them.

What a job may ask is bounded (`limits:`, LimitsSpec), so a hostile or mistaken job file fails with a message
naming the key instead of exhausting the machine. Reading a job file: config/parse.py and job/job_file.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from batchgen.engine.config import EngineConfig, check_chat_template_kwargs
from batchgen.sampling_params import NoBooleanNumbers, SamplingParams

PositiveInt = Annotated[int, Field(gt=0)]


class _Strict(NoBooleanNumbers):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ModelSpec(_Strict):
    path: str = Field(description="The model: a local folder, a Hugging Face hub id, or package:NAME (an installed "
                                  "Python package that ships weights, like the default job's SmolLM2).")
    gguf_file: str | None = Field(None, description=(
        "A GGUF file inside model.path (or inside the hub repository): dequantised once and cached under "
        "$BATCHGEN_CACHE/gguf/ (default ~/.cache/batchgen), keyed by the file's content."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "Weights and activations: auto is float32 on CPU and bfloat16 on GPU. For an FP8 checkpoint, everything "
        "but its FP8 projections."))
    device: str = Field("auto", description=(
        "Where the model runs: auto (a GPU if there is one, each worker of --gpus its own; else the CPU), cpu, "
        "cuda or cuda:N."))


class SourceSpec(_Strict):
    path: str | list[str] = Field(description=(
        "The input: a file, a glob, a list of them, a datasets save_to_disk folder, a hub dataset name, or "
        "another job's output directory."))
    type: Literal["parquet", "jsonl", "hf", "batchgen_output", "openai_batch"] | None = Field(None, description=(
        "The input's format; null infers it from the path (.parquet, .jsonl, an output directory, ...). "
        "batchgen_output reads another job's output directory (chained jobs); openai_batch an OpenAI batch "
        "input file."))
    split: str = Field("train", description=(
        "hf sources: the split to read; a split that does not exist is an error listing those that do."))
    name: str | None = Field(None, description="hf sources: the dataset's configuration (subset) name.")
    streaming: bool = Field(True, description=(
        "hf hub datasets: stream rows instead of downloading the whole dataset first."))
    key_column: str | None = Field(None, description=(
        "A column whose values identify the rows (one value a row): the output's key, by which a resumed run "
        "knows what is done. null: the row's position in the source."))
    sampling_column: str | None = Field(None, description=(
        "A column of per-row `sampling:` overrides: a JSON object (or its text) whose fields replace the job's "
        "for that row; null or empty: the job's settings. A bad value rejects its row as bad_sampling."))
    limit: PositiveInt | None = Field(None, description="Only the first N rows of the source; null reads them all.")
    # job/workers.py sized_for picks the null case's unit
    worker_unit_rows: PositiveInt | None = Field(None, description=(
        "Rows are dealt to workers (--gpus, --workers) in units of this many consecutive rows. null: sized from "
        "the source's row count so that every worker gets rows, 1,024 for large sources."))

    @model_validator(mode="after")
    def _some_path(self) -> SourceSpec:
        if self.path == [] or self.path == "" or (isinstance(self.path, list) and "" in self.path):
            raise ValueError("source.path names no input: give a file, a glob, a folder or a list of them")
        return self


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

    max_samples_per_row: PositiveInt = Field(256, description=(
        "sampling.n at most this (a larger one stops the job naming sampling.n). A line of an OpenAI batch file "
        "may ask for at most 128."))
    max_render_steps: PositiveInt = Field(1_000_000, description=(
        "Loop iterations and calls one prompt.template render may take (range() counts its length)."))
    max_prompt_chars: PositiveInt = Field(4_000_000, description=(
        "Characters: no string a template builds, no rendered prompt or chat-template output longer than this; "
        "a longer prompt is rejected as prompt_too_long (or cut, per prompt.on_too_long)."))
    render_timeout_s: Annotated[float, Field(gt=0, le=1e9)] = Field(5.0, description=(
        "Seconds of wall time one render may take (at most 1e9), the chat template included. A row over a limit is "
        "rejected (template_error / chat_template_error); a template over one on each of its first rows stops the "
        "job."))


class PromptSpec(_Strict):
    template: str | None = Field(None, description=(
        'A Jinja2 template over the row\'s columns, for example "Summarize: {{ text }}". Set exactly one of '
        "template, column and messages_column."))
    column: str | None = Field(None, description="A column whose text is the prompt, as it is.")
    messages_column: str | None = Field(None, description=(
        "A column holding the chat as a list of {role, content} messages (needs chat: true)."))
    system: str | None = Field(None, description="A system prompt put before the row's turns (chat: true).")
    chat: bool = Field(True, description=(
        "Apply the tokenizer's chat template (the prompt becomes the user's turn); false feeds the text as it is."))
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "Extra variables passed to the tokenizer's chat template (for example enable_thinking: false)."))
    on_too_long: Literal["reject", "truncate_left", "truncate_right"] = Field("reject", description=(
        "A prompt longer than max_prompt_tokens: reject the row (prompt_too_long), or keep its last "
        "(truncate_left) or first (truncate_right) tokens."))
    max_prompt_tokens: PositiveInt | None = Field(None, description=(
        "Prompt tokens at most; null: the model's context minus sampling.max_new_tokens."))
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
        check_chat_template_kwargs(self.chat_template_kwargs)
        return self


class ReasoningSpec(_Strict):
    """Think markers of a reasoning model, as text (each usually one token of the vocabulary)."""

    start: Annotated[str, Field(min_length=1)] = Field("<think>", description=(
        "The text (usually one token) that opens a think block."))
    end: Annotated[str, Field(min_length=1)] = Field("</think>", description=(
        "The text (usually one token) that closes a think block."))


class OutputSpec(_Strict):
    dir: str | None = Field(None, description=(
        "The output directory; null: out/<name> next to the job file. `batchgen run --output` overrides it."))
    rows_per_shard: PositiveInt = Field(1000, description=(
        "Input rows per data shard (a row's n samples stay together in one shard)."))
    commit_interval_s: Annotated[float, Field(gt=0)] = Field(60.0, description=(
        "Seconds: commit what is finished at least this often, even if a shard is short (how much work a crash "
        "can lose)."))
    keep_columns: Literal["all", "none"] | list[str] = Field("all", description=(
        "Source columns copied to the output: all, none, or a list of names (each once)."))
    keep_prompt: bool = Field(False, description="Also store the rendered prompt (column prompt).")
    keep_token_ids: bool = Field(False, description=(
        "Also store each completion's token ids (column completion_token_ids, list<int32>; a stop token id is "
        "kept, as counted in num_completion_tokens)."))
    logprob_tokens: bool = Field(False, description=(
        "With sampling.logprobs: also store each token's text beside its id, in completion_logprob_tokens (the "
        "generated tokens) and as `token` in each completion_top_logprobs entry. Each token is decoded alone: "
        "one holding part of a character shows as U+FFFD."))
    report: bool = Field(True, description=(
        "When a run ends, write README.md (a dataset card), reports/*.png plots and reports/index.html."))
    reasoning: Literal["auto", "none"] | ReasoningSpec = Field("none", description=(
        "Split a reasoning model's think block from its answer: auto uses the tokenizer's <think> / </think> "
        "tokens if it has them; or give {start, end}. With markers, `completion` holds the answer only, "
        "`reasoning` the think block's text and `num_reasoning_tokens` its length; none keeps the whole text "
        "in `completion`."))

    @model_validator(mode="after")
    def _columns_once(self) -> OutputSpec:
        if isinstance(self.keep_columns, list):
            twice = sorted({c for c in self.keep_columns if self.keep_columns.count(c) > 1})
            if twice:
                raise ValueError(f"output.keep_columns names {', '.join(map(repr, twice))} more than once; list "
                                 f"each column once")
        return self


class JobSampling(SamplingParams):
    """The job's `sampling:` section: SamplingParams plus what only a job can say (it names a source column)."""

    response_format_column: str | None = Field(None, description=(
        "A column holding a JSON Schema per row (JSON text or an object): that row's response_format (type "
        "json_schema); null or empty in a row: the job's response_format. A value that is not a valid schema "
        "rejects its row as bad_response_format."))

    @model_validator(mode="after")
    def _column_rows_end_by_grammar(self) -> JobSampling:
        if self.response_format_column is not None and (self.min_new_tokens
                                                        or self.thinking_budget is not None):
            raise ValueError("response_format_column decides where its rows end: it cannot be combined with "
                             "min_new_tokens > 0 or thinking_budget")
        return self


class JobSpec(_Strict):
    name: str | None = Field(None, description=(
        "A label for the job; also names the default output folder out/<name> next to the job file."))
    model: ModelSpec = Field(description=(
        "Which model generates: a local folder, a hub id, or package:NAME (an installed package shipping "
        "weights)."))
    source: SourceSpec = Field(description=(
        "Where the rows come from: Parquet, JSONL, a datasets folder or hub dataset, an OpenAI batch file, or "
        "another job's output directory."))
    prompt: PromptSpec = Field(description=(
        "How a row becomes a prompt: exactly one of template, column and messages_column, optionally through "
        "the chat template."))
    # SamplingParams (sampling_params.py) plus what only a job can say
    sampling: JobSampling = Field(default_factory=JobSampling, description=(
        "What to generate for each row: the Python API's SamplingParams, plus response_format_column."))
    engine: EngineConfig = Field(default_factory=EngineConfig, description=(
        "Speed knobs of the engine (the Python API's EngineConfig). They may change between resumed runs, "
        "except deterministic and kv_cache_dtype, which change the numerics, and max_model_len, which decides which "
        "prompts fit and where completions stop: those are part of the fingerprint."))
    output: OutputSpec = Field(default_factory=OutputSpec, description=(
        "Where and how the results are written. The whole section is optional."))
    limits: LimitsSpec = Field(default_factory=LimitsSpec, description=(
        "Bounds on what a job may ask, so that a mistaken or hostile job file fails with a message naming the "
        "key. Not part of the fingerprint: raise one and resume."))

    @model_validator(mode="after")
    def _within_limits(self) -> JobSpec:
        if self.output.logprob_tokens and self.sampling.logprobs is None:
            raise ValueError("output.logprob_tokens stores the text of the log-probs' tokens: it needs "
                             "sampling.logprobs (0 for the sampled tokens alone, K for the top K as well)")
        if self.sampling.n > self.limits.max_samples_per_row:
            raise ValueError(f"'sampling.n' = {self.sampling.n}: more samples per row than "
                             f"limits.max_samples_per_row ({self.limits.max_samples_per_row}); lower sampling.n "
                             f"or raise limits.max_samples_per_row (each sample holds its own sequence)")
        self.prompt._limits = self.limits
        return self


# ---- loading ---------------------------------------------------------------------------------------

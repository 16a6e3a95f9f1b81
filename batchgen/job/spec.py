"""JobSpec: the job file, validated and frozen before anything heavy loads. Its `sampling:` and `engine:`
sections are the Python API's SamplingParams and EngineConfig themselves (one definition per setting).

Unknown keys are errors that suggest the closest valid key; wrong types and values name the key and
the value. Relative paths resolve against the job file's folder. `--set a.b=value` overrides any key.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from batchgen.engine.config import EngineConfig
from batchgen.errors import JobError
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


class PromptSpec(_Strict):
    template: str | None = None  # Jinja2 over the row's columns: "Summarize: {{ text }}"
    column: str | None = None  # the prompt is this column's text
    messages_column: str | None = None  # a list of {role, content} chat messages
    system: str | None = None
    chat: bool = True  # apply the tokenizer's chat template
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    on_too_long: Literal["reject", "truncate_left", "truncate_right"] = "reject"
    max_prompt_tokens: PositiveInt | None = None  # default: model context - max_new_tokens

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
    # issue 14: logprobs / reasoning
    # auto: the tokenizer's <think> / </think> tokens if it has them, else none; with markers, `completion` holds
    # the answer only, `reasoning` the think block's text, `num_reasoning_tokens` its length
    reasoning: Literal["auto", "none"] | ReasoningSpec = "none"


# issue 14: structured output
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


# ---- loading ---------------------------------------------------------------------------------------

def _fields_at(loc: tuple) -> list[str]:
    model: Any = JobSpec
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
    return [f.alias or name for name, f in model.model_fields.items()]


def _format_validation_error(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        key = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            valid = _fields_at(loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
            hint = f"did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'?" if close else \
                f"valid keys here: {', '.join(valid)}"
            lines.append(f"unknown key '{key}': {hint}")
        elif e["type"] == "missing":
            lines.append(f"missing required key '{key}'")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            shown = repr(e["input"]) if not isinstance(e["input"], dict) else "{...}"
            lines.append(f"'{key}' = {shown}: {msg}" if loc else msg)
    return f"invalid job file {origin}:\n  - " + "\n  - ".join(lines)


def apply_override(raw: dict, assignment: str) -> None:
    """`a.b.c=value` sets raw['a']['b']['c'] = yaml(value)."""
    if "=" not in assignment:
        raise JobError(f"--set {assignment!r}: expected KEY.PATH=VALUE, e.g. --set sampling.temperature=0")
    path, _, text = assignment.partition("=")
    parts = path.strip().split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise JobError(f"--set {assignment!r}: '{p}' is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise JobError(f"--set {assignment!r}: the value is not valid YAML ({e})") from None


def _resolve(base: Path, value: str, normalize: bool = False) -> str:
    """Resolve a relative local path against the job file's folder; leave hub ids and URLs alone.
    `normalize` folds `a/../b` (not for model.path: it is part of the fingerprint as written)."""
    if "://" in value or value.startswith("package:"):
        return value
    if value.startswith("~"):
        value = str(Path(value).expanduser())
    if Path(value).is_absolute():
        return os.path.normpath(value) if normalize else value
    candidate = base / value
    looks_local = (value.startswith(".") or candidate.exists() or (base / Path(value).parts[0]).exists()
                   or any(c in value for c in "*?["))
    if not looks_local:
        return value
    return os.path.normpath(candidate) if normalize else str(candidate)


def _default_output_dir(spec: JobSpec, job_path: Path, base: Path) -> Path:
    """out/<name> next to the job file; name = the job's `name:`, else the job file's stem."""
    name = spec.name if spec.name is not None else job_path.stem
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise JobError(f"name {name!r} in {job_path} cannot name the default output folder out/<name>: "
                       f"give a plain name, or set output.dir")
    return base / "out" / name


def _openai_batch_defaults(raw: dict, base: Path) -> None:
    """An OpenAI batch file as the source (source.type openai_batch, or a .jsonl whose first line has custom_id
    and body): key rows by custom_id, take each line's sampling fields, and prompt with its messages (chat) or
    prompt (completions), unless the job says otherwise."""
    from batchgen.sources.openai_batch import sniff

    import glob

    source = raw.get("source")
    if not isinstance(source, dict) or source.get("type") not in (None, "openai_batch") or \
            not isinstance(source.get("path"), (str, list)) or not source["path"]:
        return
    first = source["path"] if isinstance(source["path"], str) else source["path"][0]
    files = sorted(glob.glob(_resolve(base, str(first)))) or [_resolve(base, str(first))]
    column = sniff(files[0])
    if column is None:
        if source.get("type") != "openai_batch":
            return
        column = "messages"  # said so, but not readable here: the source says what is wrong when it opens
    source.setdefault("type", "openai_batch")
    source.setdefault("key_column", "custom_id")
    source.setdefault("sampling_column", "sampling")
    raw.setdefault("prompt", {"messages_column": "messages"} if column == "messages" else
                   {"column": "prompt", "chat": False})


def _check_response_format(spec: JobSpec, path: Path) -> None:
    """issue 14: structured output: a schema, regex or grammar xgrammar refuses stops the job here, before any
    model loads (run and validate), naming the key and xgrammar's reason."""
    if spec.sampling.response_format is None:
        return
    from batchgen.sample.grammar import check_response_format

    try:
        check_response_format(spec.sampling.response_format)
    except ValueError as e:
        raise JobError(f"invalid job file {path}:\n  - {e}") from None


def load_spec(path: str | Path, overrides: list[str] = (), output_dir: str | None = None) -> JobSpec:
    path = Path(path)
    if not path.is_file():
        raise JobError(f"job file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise JobError(f"job file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise JobError(f"job file {path} must be a mapping of sections (model, source, prompt, ...), "
                       f"got {type(raw).__name__}")
    for o in overrides:
        apply_override(raw, o)
    _openai_batch_defaults(raw, path.resolve().parent)
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as e:
        raise JobError(_format_validation_error(e, str(path))) from None
    _check_response_format(spec, path)
    base = path.resolve().parent
    model = spec.model.model_copy(update={"path": _resolve(base, spec.model.path)})
    paths = [spec.source.path] if isinstance(spec.source.path, str) else spec.source.path
    resolved = [_resolve(base, p, normalize=True) for p in paths]
    source = spec.source.model_copy(update={"path": resolved[0] if isinstance(spec.source.path, str) else resolved})
    if output_dir is not None:  # --output: relative to the current folder
        out_dir = Path(output_dir).resolve()
    elif spec.output.dir is not None:  # output.dir: relative to the job file's folder
        out_dir = (base / spec.output.dir).resolve()
    else:
        out_dir = _default_output_dir(spec, path, base)
    output = spec.output.model_copy(update={"dir": str(out_dir)})
    return spec.model_copy(update={"model": model, "source": source, "output": output})

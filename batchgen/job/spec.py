"""JobSpec: the job file, validated and frozen before anything heavy loads. Its `sampling:` and `engine:`
sections are the Python API's SamplingParams and EngineConfig themselves (one definition per setting).

Unknown keys are errors that suggest the closest valid key; wrong types and values name the key and
the value. Relative paths resolve against the job file's folder. `--set a.b=value` overrides any key.

What a job may ask is bounded (`limits:`, LimitsSpec; the job file itself: MAX_JOB_FILE_BYTES, MAX_YAML_NODES),
so a hostile or mistaken job file fails with a message naming the key instead of exhausting the machine.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from batchgen.engine.config import EngineConfig
from batchgen.errors import JobError
from batchgen.sampling_params import SamplingParams

PositiveInt = Annotated[int, Field(gt=0)]

# The job file is read before any spec exists, so its own bounds are constants, not keys. A YAML alias expands
# to a copy of its anchor wherever a mapping is validated or dumped: nine nested aliases of nine items are
# 9**9 nodes from a few hundred bytes. Aliases stay allowed (`<<: *defaults`) while the expanded document is
# at most MAX_YAML_NODES nodes.
MAX_JOB_FILE_BYTES = 4 << 20
MAX_YAML_NODES = 1_000_000
# No model's context holds more tokens; the model's own context (engine.max_model_len or the config's
# max_position_embeddings) bounds it further, checked where the config is read (validate, run).
MAX_NEW_TOKENS = 1 << 24


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
    # issue 14: logprobs / reasoning
    # auto: the tokenizer's <think> / </think> tokens if it has them, else none; with markers, `completion` holds
    # the answer only, `reasoning` the think block's text, `num_reasoning_tokens` its length
    reasoning: Literal["auto", "none"] | ReasoningSpec = "none"


# issue 14: structured output
class JobSampling(SamplingParams):
    """The job's `sampling:` section: SamplingParams plus what only a job can say (it names a source column)."""

    # a column holding a JSON Schema per row (JSON text): that row's response_format (type json_schema)
    response_format_column: str | None = None

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new_tokens_fits_a_context(cls, value: int) -> int:
        if value > MAX_NEW_TOKENS:
            raise ValueError(f"more than {MAX_NEW_TOKENS}, more tokens than any model's context holds; the "
                             f"model's context (engine.max_model_len or its max_position_embeddings) bounds it "
                             f"further, minus the prompt's tokens")
        return value

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


def _expanded_nodes(root: yaml.Node) -> int:
    """How many nodes the document holds once every alias is expanded, up to MAX_YAML_NODES + 1. The composed
    graph shares an aliased node between its uses, so each node's expanded size is computed once (memo by id),
    without recursion (a deeply nested document is not a RecursionError here)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else \
            list(node.value) if isinstance(node, yaml.SequenceNode) else []
        if not children_done and any(id(c) not in sizes for c in children):
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        sizes[id(node)] = min(1 + sum(sizes.get(id(c), 0) for c in children), MAX_YAML_NODES + 1)
    return sizes[id(root)]


def load_yaml(text: str, origin: str):
    """YAML text as Python values, bounded: JobError naming `origin` when it is larger than MAX_JOB_FILE_BYTES,
    expands (through aliases) to more than MAX_YAML_NODES nodes, nests too deeply to parse, or is not YAML."""
    if len(text) > MAX_JOB_FILE_BYTES:
        raise JobError(f"{origin} is {len(text)} characters long, more than the {MAX_JOB_FILE_BYTES} a job file may "
                       f"hold; keep large data (schemas, prompts) in the source's columns")
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_nodes(node) > MAX_YAML_NODES:
            raise JobError(f"{origin} expands to more than {MAX_YAML_NODES} YAML nodes through its aliases (*name); "
                           f"an alias copies its anchor wherever it is used: write the values out, or use fewer "
                           f"nested aliases")
        return loader.construct_document(node)
    except RecursionError:
        raise JobError(f"{origin} nests its values too deeply to read; flatten it") from None
    except yaml.YAMLError as e:
        raise JobError(f"{origin} is not valid YAML: {e}") from None
    finally:
        loader.dispose()


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
    node[parts[-1]] = load_yaml(text, f"--set {assignment!r}: the value") if text.strip() else ""


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
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise JobError(f"job file {path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    raw = load_yaml(text, f"job file {path}")
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

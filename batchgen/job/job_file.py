"""load_spec: a job file read, validated and resolved (paths, output folder, an OpenAI batch file's defaults, the
response format checked) before anything heavy loads. The schema itself: batchgen/config/."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from batchgen.config.parse import _default_output_dir, _format_validation_error, _resolve, apply_override, load_yaml
from batchgen.config.schema import JobSpec
from batchgen.errors import JobError


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


def check_before_run(spec: JobSpec, path: Path) -> None:
    """What a job about to run (or be validated) may not hold, beyond the schema: a saved job of an output begun by an
    earlier batchgen is read by export, status and the card without these checks. Structured output: a schema, regex
    or grammar xgrammar refuses stops the job before any model loads, naming the key and xgrammar's reason.
    prompt.chat_template_kwargs without a chat template (chat: false) would be ignored without a word."""
    if spec.prompt.chat_template_kwargs and not spec.prompt.chat:
        raise JobError(f"invalid job file {path}:\n  - prompt.chat_template_kwargs are the chat template's variables; "
                       f"with prompt.chat: false no chat template runs: drop them, or set prompt.chat: true")
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
    check_before_run(spec, path)
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

"""The job-file reference, generated from the pydantic models (batchgen.config.JobSpec and every section it
holds), so that it cannot drift from the code.

Used two ways:
- as an MkDocs hook (mkdocs.yml `hooks:`): the marker JOB_REFERENCE_MARKER in a page is replaced at build time
  by one table per section (key path, type, default, description);
- by tests/project/test_docs.py, which walks the same keys and checks each one has a description.

A key's description is its field's `Field(description=...)`, written for users; the models are the only source.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

JOB_REFERENCE_MARKER = "<!-- job-reference -->"


@dataclass(frozen=True)
class Key:
    path: str  # the key as the job file spells it: sampling.response_format.type
    type: str
    default: str
    description: str
    section: str  # the top-level section: model, source, ...


# ---- types and defaults --------------------------------------------------------------------------------------

def _is_model(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


# The job file's spelling where the model stores another form (a mapping kept as sorted pairs, one string as a
# list of one).
YAML_TYPES = {
    "sampling.logit_bias": "mapping[int, float (>= -100, <= 100)]",
    "sampling.stop": "str | list[str]",
}


def _bounds(meta) -> list[str]:
    bounds = []
    for m in meta:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(m, attr, None)
            if value is None and hasattr(m, "metadata"):
                value = next((getattr(x, attr) for x in m.metadata if getattr(x, attr, None) is not None), None)
            if value is not None:
                bounds.append(f"{sign} {value}")
    return bounds


def _with_meta(text: str, meta) -> str:
    bounds = _bounds(meta)
    text = f"{text} ({', '.join(bounds)})" if bounds else text
    if any(type(m).__name__ == "WrapValidator" for m in meta):  # engine sizes: a number or auto
        text = f"{text} | auto"
    return text


def _format_type(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *meta = typing.get_args(tp)
        return _with_meta(_format_type(base), meta)
    if origin is typing.Literal:
        return " | ".join("null" if a is None else str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_format_type(a) for a in typing.get_args(tp))
    if origin in (list, tuple, dict):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        inner = ", ".join(_format_type(a) for a in args)
        name = {list: "list", tuple: "list", dict: "mapping"}[origin]
        return f"{name}[{inner}]" if inner else name
    if tp is type(None):
        return "null"
    if _is_model(tp):
        return "section"
    if tp is typing.Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _field_type(path: str, field: FieldInfo) -> str:
    if path in YAML_TYPES:
        return YAML_TYPES[path]
    return _with_meta(_format_type(field.annotation), field.metadata)


YAML_DEFAULTS = {"sampling.logit_bias": "{}"}


def _format_default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple) and not value:
        return "[]" if not isinstance(field.annotation, dict) else "{}"
    if isinstance(value, int) and type(value) is not int:  # engine's Auto
        return str(value)
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}".replace(",", "_")
    if value == {}:
        return "{}"
    return str(value)


def _nested_models(tp) -> list[type[BaseModel]]:
    if _is_model(tp):
        return [tp]
    return [m for a in typing.get_args(tp) for m in _nested_models(a)]


# ---- the walk ------------------------------------------------------------------------------------------------

def walk(model: type[BaseModel] | None = None, prefix: str = "") -> list[Key]:
    """Every key of the job file, depth first, in declaration order."""
    if model is None:
        from batchgen.config import JobSpec

        model = JobSpec
    keys: list[Key] = []
    for name, field in model.model_fields.items():
        yaml_name = field.alias or name
        path = f"{prefix}{yaml_name}"
        nested = _nested_models(field.annotation)
        keys.append(Key(path=path, type=_field_type(path, field),
                        default=YAML_DEFAULTS.get(path) or _format_default(field),
                        description=" ".join((field.description or "").split()), section=path.split(".")[0]))
        for sub in nested:
            keys.extend(walk(sub, f"{path}."))
    return keys


# ---- the page ------------------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    """Table-cell markdown: pipes escaped, and < > & outside code spans as entities (<think> is not HTML)."""
    parts = text.replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("|", "\\|")


def key_cell(path: str) -> str:
    """A key as its table cell: code that may break after a dot only (`<wbr>`; docs/stylesheets/reference.css keeps
    each name whole), its underscores as entities so that Markdown reads no emphasis in them."""
    parts = [part.replace("_", "&#95;") for part in path.split(".")]
    return '<code class="job-key">' + ".<wbr>".join(parts) + "</code>"


# The guide pages that explain each section (links relative to docs/guide/job-reference.md).
SECTION_GUIDES = {
    "model": "[Installation](installation.md#models-and-the-hub), [Big models](big-models.md)",
    "source": "[Inputs](inputs.md)",
    "prompt": "[Prompts and templates](prompts.md)",
    "sampling": "[Sampling](sampling.md), [Structured output](structured-output.md), [Log-probs](logprobs.md), "
                "[Reasoning models](reasoning.md)",
    "engine": "[Performance](performance.md#tuning-a-job), [Reproducible datasets](deterministic.md), "
              "[Big models](big-models.md)",
    "output": "[The output directory](output.md), [Reasoning models](reasoning.md)",
    "limits": "[Prompts and templates](prompts.md#templates)",
}


def render() -> str:
    from batchgen.config import JobSpec

    keys = walk(JobSpec)
    out: list[str] = []
    section = None
    for key in keys:
        if key.section != section:
            section = key.section
            out += ["", f"## `{section}`", ""]
            if key.type == "section":
                out += [_cell(key.description), ""]
            if section in SECTION_GUIDES:
                out += [f"Guide: {SECTION_GUIDES[section]}.", ""]
            out += ["| key | type | default | description |", "|---|---|---|---|"]
            if key.type == "section":
                continue
        out.append(f"| {key_cell(key.path)} | {_cell(key.type)} | `{_cell(key.default)}` | {_cell(key.description)} |")
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page, config, files):  # MkDocs hook
    if JOB_REFERENCE_MARKER in markdown:
        return markdown.replace(JOB_REFERENCE_MARKER, render())
    return markdown

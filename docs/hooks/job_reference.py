"""The job-file reference, generated from the pydantic models (batchgen.config.JobSpec and every section it
holds), so that it cannot drift from the code.

Used two ways:
- as an MkDocs hook (mkdocs.yml `hooks:`): the marker JOB_REFERENCE_MARKER in a page is replaced at build time
  by one table per section (key path, type, default, description);
- by tests/test_docs.py, which walks the same keys and checks each one has a description.

A key's description comes from, in order: the field's `Field(description=...)`; its comment in the source (a
trailing `# comment` on the field's line, else the comment lines right above it), read with inspect.getsource and
tokenize; else docs/hooks/job_keys.yaml (for fields the code does not describe yet). Comments that name how the
project was built (issue numbers, work periods) are left out.
"""

from __future__ import annotations

import inspect
import io
import re
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

JOB_REFERENCE_MARKER = "<!-- job-reference -->"
SUPPLEMENT = Path(__file__).with_name("job_keys.yaml")


@dataclass(frozen=True)
class Key:
    path: str  # the key as the job file spells it: sampling.response_format.type
    type: str
    default: str
    description: str
    source: str  # "Field", "comment" or "job_keys.yaml"
    section: str  # the top-level section: model, source, ...


# ---- source comments -----------------------------------------------------------------------------------------

_NOISE = [
    (re.compile(r"^\s*issue \d+:\s*"), ""),  # "issue 14: ..." prefixes (a short heading after it is dropped)
    (re.compile(r"\(\s*sessions? \d+(?:\s*(?:and|,)\s*\d+)*\s*\)"), ""),  # a work period in parentheses
    (re.compile(r",?\s*\bsessions? \d+(?:\s*(?:and|,)\s*\d+)*\b"), ""),  # one after a reference: "(bench/RESULTS.md, ...)"
    (re.compile(r"\s+([,;:.)])"), r"\1"),
]


def _clean(text: str) -> str:
    lines = []
    source = text.splitlines()
    for i, line in enumerate(source):
        pattern, repl = _NOISE[0]
        heading = bool(pattern.match(line))
        if heading:
            line = pattern.sub(repl, line)
        # a group heading such as "structured output": a short first line with more below it, no sentence
        heading = heading or (i == 0 and len(source) > 1 and not re.search(r"[.:;,()`]", line))
        if heading and len(line.split()) < 6:
            continue
        if line.strip():
            lines.append(line.strip())
    text = " ".join(lines)
    for pattern, repl in _NOISE[1:]:
        text = pattern.sub(repl, text)
    text = re.sub(r"\bNone\b", "null", text)
    return re.sub(r"\s{2,}", " ", text).strip()


@cache
def _class_comments(cls: type) -> dict[str, str]:
    """{field name: its comment} for the fields `cls` itself declares: the trailing comment on the line where the
    field's name starts, else the block of comment lines (at the field's indent) right above it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    comments_by_line: dict[int, tuple[int, str]] = {}  # line -> (column, text)
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            comments_by_line[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip())
    body_indent = next((tok.end[1] for tok in tokens if tok.type == tokenize.INDENT), None)
    result: dict[str, str] = {}
    for i, tok in enumerate(tokens):
        if tok.type != tokenize.NAME or tok.start[1] != body_indent:
            continue
        if tok.start[1] != body_indent or tokens[i - 1].type not in (tokenize.INDENT, tokenize.NL,
                                                                     tokenize.NEWLINE, tokenize.DEDENT):
            continue
        if i + 1 >= len(tokens) or tokens[i + 1].string != ":" or tok.string in ("def", "class", "if", "for"):
            continue
        line = tok.start[0]
        above = []
        prev = line - 1
        while prev in comments_by_line and comments_by_line[prev][0] == body_indent:
            above.append(comments_by_line[prev][1])
            prev -= 1
        parts = list(reversed(above))
        trailing = comments_by_line.get(line)
        if trailing is not None and trailing[0] > tok.start[1]:
            parts.append(trailing[1])
        if parts:
            result[tok.string] = "\n".join(parts)
    return result


def _declaring_class(model: type[BaseModel], name: str) -> type | None:
    for cls in model.__mro__:
        if name in getattr(cls, "__annotations__", {}):
            return cls
    return None


@cache
def _supplement() -> dict[str, str]:
    return yaml.safe_load(SUPPLEMENT.read_text()) or {} if SUPPLEMENT.is_file() else {}


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
        description, source = _describe(model, name, field, path)
        nested = _nested_models(field.annotation)
        keys.append(Key(path=path, type=_field_type(path, field), default=YAML_DEFAULTS.get(path) or _format_default(field),
                        description=description, source=source, section=path.split(".")[0]))
        for sub in nested:
            keys.extend(walk(sub, f"{path}."))
    return keys


def _describe(model: type[BaseModel], name: str, field: FieldInfo, path: str) -> tuple[str, str]:
    if field.description:
        return _clean(field.description), "Field"
    sections = _nested_models(field.annotation)
    if sections and "." not in path and path in _supplement():  # a top-level section: the user's summary of it
        return _clean(_supplement()[path]), "job_keys.yaml"
    owner = _declaring_class(model, name)
    comment = _class_comments(owner).get(name, "") if owner is not None else ""
    comment = _clean(comment)
    if comment:
        return comment, "comment"
    return _clean(_supplement().get(path, "")), "job_keys.yaml"


# ---- the page ------------------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    """Table-cell markdown: pipes escaped, and < > & outside code spans as entities (<think> is not HTML)."""
    parts = text.replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("|", "\\|")


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
        out.append(f"| `{key.path}` | {_cell(key.type)} | `{_cell(key.default)}` | {_cell(key.description)} |")
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page, config, files):  # MkDocs hook
    if JOB_REFERENCE_MARKER in markdown:
        return markdown.replace(JOB_REFERENCE_MARKER, render())
    return markdown

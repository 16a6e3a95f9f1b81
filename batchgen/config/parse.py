"""Reading a job file's YAML, bounded, and the messages of a spec that does not validate: unknown keys suggest the
closest valid key, wrong types and values name the key and the value. `--set a.b=value` overrides any key.
Relative paths resolve against the job file's folder."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from batchgen.config.schema import JobSpec
from batchgen.errors import JobError

# The job file is read before any spec exists, so its own bounds are constants, not keys. A YAML alias expands
# to a copy of its anchor wherever a mapping is validated or dumped: nine nested aliases of nine items are
# 9**9 nodes from a few hundred bytes. Aliases stay allowed (`<<: *defaults`) while the expanded document is
# at most MAX_YAML_NODES nodes.
MAX_JOB_FILE_BYTES = 4 << 20
MAX_YAML_NODES = 1_000_000


# Keys and values a job file could once hold, with what to do instead: refused as any unknown key or value is,
# but the message says that it was removed rather than misspelt.
REMOVED_KEYS = {
    "engine.admission_group": "this option was removed (starting waiting prompts in groups gave no measured "
                              "gain; they start as soon as a sequence slot frees): delete the line",
}
REMOVED_VALUES = {
    ("engine.graph_blas_library", "auto"): "auto was removed (choosing the library per batch size at start-up "
                                           "never beat cublaslt): use cublaslt (the default), cublas or null",
}


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
        removed = REMOVED_VALUES.get((key, e["input"])) if isinstance(e["input"], str) else None
        if e["type"] == "extra_forbidden" and key in REMOVED_KEYS:
            lines.append(f"unknown key '{key}': {REMOVED_KEYS[key]}")
        elif removed is not None:
            lines.append(f"'{key}' = {e['input']!r}: {removed}")
        elif e["type"] == "extra_forbidden":
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


def _duplicate_key(root: yaml.Node) -> tuple[str, int, int] | None:
    """The first key written twice in one mapping, with the lines of both (1-based), or None. YAML loaders keep
    the last value silently; a job file's second `temperature:` is a mistake to name, not a setting to guess."""
    seen_nodes: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if key.value in lines:
                        return key.value, lines[key.value], key.start_mark.line + 1
                    lines[key.value] = key.start_mark.line + 1
                stack += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
    return None


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
        duplicate = _duplicate_key(node)
        if duplicate is not None:
            key, first, second = duplicate
            raise JobError(f"{origin}: key {key!r} is written twice in one section (lines {first} and {second}); "
                           f"keep one")
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
        if node.get(p) is None:  # absent, or written empty (`sampling:`) or null: the override starts it
            node[p] = {}
        node = node[p]
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

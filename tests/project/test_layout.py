"""The package layout holds: each folder imports only the layers below it, the host side of the engine needs no
torch, and no two modules import each other (directly or around a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "batchgen"

# folder (or module) -> the batchgen folders/modules it may import, lazy imports included; every module of the
# package is under exactly one key (the most specific); "" = batchgen's top-level leaf modules
LOWER = {"errors", "hub", "seeding", "sampling_params", "sandbox"}  # leaf modules every layer may use
ENGINE_CORE = {"engine", "sampling_params", "seeding", "errors"}
ALLOWED = {
    "kernels": {"kernels"},
    # quantised checkpoints: schemes, loading, the FP8 linear layer the models use
    "quant": {"quant", "kernels", "errors"},
    "attention": {"attention", "kernels"},
    "models": {"models", "quant", "attention", "kernels"},
    "sample": {"sample", "engine.batch", "kernels"},
    # engine.sizing: pure arithmetic over graph buckets, as engine.batch is plain data
    "runner": {"runner", "models", "quant", "attention", "sample", "kernels", "engine.batch", "engine.sizing", "errors",
               "hub"},
    # tensor parallelism: groups and plans; beside runner/ (the runner reaches it only through the group it is given)
    "distributed": {"distributed", "models", "quant", "attention", "kernels", "engine.batch", "errors"},
    "engine": ENGINE_CORE,
    # composition root of the engine (sample: the grammar cache of structured output)
    "engine/engine.py": ENGINE_CORE | {"runner", "distributed", "attention", "sample"},
    # the job's schema: below everything that reads a setting
    "config": {"config", "engine.config", "sampling_params", "errors"},
    "prompts.py": {"config", "errors", "sandbox"},
    "sandbox.py": {"errors"},
    "output": {"output", "config", "engine.detokenizer", "engine.reasoning", "errors"},
    "sources": {"sources", "config", "output", "prompts"} | LOWER,
    # the job runner: the composition root of a run
    "job": {"job", "config", "sources", "output", "prompts", "engine", "runner", "models", "quant", "attention", "sample",
            "kernels", "distributed"} | LOWER,
    "bench": {"bench", "job", "config", "engine", "runner", "models", "quant", "attention", "kernels", "distributed",
              "sample"} | LOWER,
    # Ray: a driver dealing units to JobLoop workers (tensor-parallel ones: process groups, the device), and a Ray
    # Data stage over engines (which checks the job's structured output as run does: sample's grammar checks)
    "ray": {"ray", "job", "config", "sources", "output", "prompts", "engine", "distributed", "runner", "sample"}
    | LOWER,
    "cli.py": {"job", "config", "output", "sources", "bench", "distributed", "ray"} | LOWER,
    "__init__.py": {"engine", "sampling_params"},
    "errors.py": set(), "hub.py": {"errors"}, "seeding.py": set(), "sampling_params.py": set(),
}
HOST_ONLY = ("engine/batch.py", "engine/block_manager.py", "engine/config.py", "engine/detokenizer.py",
             "engine/list_mirror.py", "engine/request.py", "engine/results.py", "engine/scheduler.py", "sampling_params.py")


def _imports(path: Path) -> set[str]:
    """Every module name imported anywhere in the file (also inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}  # `from batchgen.x import module`
    return names


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _batchgen_targets(path: Path) -> set[str]:
    known = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    return {n for n in _imports(path) if n in known and n != "batchgen"}


def _rule(path: Path) -> str | None:
    """The most specific ALLOWED key covering this module."""
    rel = path.relative_to(PACKAGE).as_posix()
    if rel in ALLOWED:
        return rel
    parts = rel.split("/")
    for i in range(len(parts) - 1, 0, -1):
        if "/".join(parts[:i]) in ALLOWED:
            return "/".join(parts[:i])
    return None


def test_every_module_has_a_rule():
    assert [p for p in PACKAGE.rglob("*.py") if _rule(p) is None] == []


def test_each_folder_imports_only_the_layers_below_it():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        allowed = ALLOWED[_rule(path)]
        for target in _batchgen_targets(path):
            rest = target.removeprefix("batchgen.")
            if not any(rest == a or rest.startswith(a + ".") for a in allowed):
                problems.append(f"{path.relative_to(PACKAGE)} imports {target}")
    assert not problems, "\n".join(problems)


def test_the_host_side_of_the_engine_imports_no_torch():
    problems = [f"{rel} imports {name}" for rel in HOST_ONLY for name in _imports(PACKAGE / rel)
                if name == "torch" or name.startswith("torch.")]
    assert not problems, "\n".join(problems)


def test_no_import_cycle_lazy_imports_included():
    graph = {_module_name(path): _imports(path) for path in PACKAGE.rglob("*.py")}
    graph = {m: {t for t in ts if t in graph and t != m and t != "batchgen"} for m, ts in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in graph[m]:
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_every_source_type_the_job_file_names_has_its_line_in_the_sources_mapping():
    from typing import get_args

    from batchgen.config import SourceSpec
    from batchgen.sources import SOURCE_TYPES

    named = {a for a in get_args(get_args(SourceSpec.model_fields["type"].annotation)[0])}
    assert named == set(SOURCE_TYPES)

"""The package layout holds: each folder imports only the layers below it, the host side of the engine needs no
torch, and no two modules import each other (directly or around a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "batchgen"

# folder (or module) -> the batchgen folders/modules it may import; "" = batchgen's top-level leaf modules
ALLOWED = {
    "kernels": {"kernels"},
    # quantised checkpoints: schemes, loading, the FP8 linear layer the models use
    "quant": {"quant", "kernels", "errors"},
    "attention": {"attention", "kernels"},
    "models": {"models", "quant", "attention", "kernels"},
    "sample": {"sample", "engine.batch", "kernels"},
    "runner": {"runner", "models", "quant", "attention", "sample", "kernels", "engine.batch", "errors", "hub"},
    # tensor parallelism: groups and plans; beside runner/ (the runner reaches it only through the group it is given)
    "distributed": {"distributed", "models", "quant", "attention", "kernels", "engine.batch", "errors"},
    "engine": {"engine", "sampling_params", "seeding", "errors"},
    # composition root (sample: the grammar cache of structured output)
    "engine/engine.py": {"engine", "runner", "distributed", "attention", "sample", "sampling_params", "seeding",
                         "errors"},
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


def test_each_folder_imports_only_the_layers_below_it():
    problems = []
    for where, allowed in ALLOWED.items():
        paths = [PACKAGE / where] if where.endswith(".py") else sorted((PACKAGE / where).glob("*.py"))
        for path in paths:
            if not where.endswith(".py") and f"{where}/{path.name}" in ALLOWED:
                continue  # a file with its own rule
            for target in _batchgen_targets(path):
                rest = target.removeprefix("batchgen.")
                if not any(rest == a or rest.startswith(a + ".") for a in allowed):
                    problems.append(f"{path.relative_to(PACKAGE)} imports {target}")
    assert not problems, "\n".join(problems)


def test_the_host_side_of_the_engine_imports_no_torch():
    problems = [f"{rel} imports {name}" for rel in HOST_ONLY for name in _imports(PACKAGE / rel)
                if name == "torch" or name.startswith("torch.")]
    assert not problems, "\n".join(problems)


def test_no_module_level_import_cycle():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        module_level = set()
        for node in ast.parse(path.read_text()).body:  # module level only: imports inside functions are lazy
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                module_level |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                module_level |= {a.name for a in node.names}
        graph[_module_name(path)] = module_level
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

    from batchgen.job.spec import SourceSpec
    from batchgen.sources import SOURCE_TYPES

    named = {a for a in get_args(get_args(SourceSpec.model_fields["type"].annotation)[0])}
    assert named == set(SOURCE_TYPES)

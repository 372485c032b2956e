# kvscope: `make run` serves the default model; `make test` runs the test suite. Both set up .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Two install stamps: what serving needs (torch + kvscope[engine,gateway]: `make run`, `make pull`, `make bench`)
# and the dev tools on top (pytest, ruff, pyright, ...: `make test`, `make lint`).
STAMP := $(VENV)/.kvscope-installed
DEV_STAMP := $(VENV)/.kvscope-dev-installed
# PyTorch's build: on Linux without an NVIDIA driver the CPU wheels from PyTorch's CPU index, else pip's default
# (the CUDA build on Linux). scripts/torch_index.py says how it decides (/proc/driver/nvidia/version or
# nvidia-smi on PATH) and why. `make install TORCH_INDEX_URL=` forces pip's default build,
# `TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126` a CUDA version.
NVIDIA_DRIVER_FILE ?= /proc/driver/nvidia/version
ifeq ($(origin TORCH_INDEX_URL),undefined)
TORCH_INDEX_URL := $(shell $(PYTHON) scripts/torch_index.py --driver-file $(NVIDIA_DRIVER_FILE))
endif
# `make run PORT=4001` (or `PORT=4001 make run`): the gateway's port; empty: kvscope serve's default, 4000.
PORT ?=
PYTEST_ARGS ?=
# Test processes (pytest-xdist): the engine runs one torch thread on a 2-CPU machine, so one pytest process left
# a core idle. --dist loadfile: a test file runs on one worker, so its module fixtures (a running engine, a stack
# of processes) start once. (Not loadgroup: pytest-xdist 3.8 sets the group on Item._nodeid, which pytest 9.2's
# nodeid no longer reads, so every test became its own unit.)
TEST_WORKERS ?= 2
# python -P: the repository root stays off sys.path, where its kernels/ folder would shadow Hugging Face's
# top-level `kernels` (transformers imports it); kvscope's layers are kvscope.engine, kvscope.kernels, ...

.PHONY: run test test-fresh lint install install-dev pull bench clean

install: $(STAMP)

install-dev: $(DEV_STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "make install: PyTorch 2.13.0 from $(or $(TORCH_INDEX_URL),pip's default index) (the CPU build where no \
	NVIDIA driver is found: scripts/torch_index.py; TORCH_INDEX_URL=... overrides)"
	$(if $(TORCH_INDEX_URL),$(PY) -m pip install --no-deps torch==2.13.0 --index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install torch==2.13.0
	@echo "make install: kvscope with what serving needs (engine, gateway); make test adds the dev tools"
	$(PY) -m pip install -e '.[engine,gateway]'
	# An activated venv never puts the current folder on sys.path (as python -P): in the checkout, the root's
	# kernels/ folder would shadow Hugging Face's top-level `kernels`, which transformers imports.
	grep -q PYTHONSAFEPATH $(VENV)/bin/activate || echo 'export PYTHONSAFEPATH=1' >> $(VENV)/bin/activate
	touch $@

$(DEV_STAMP): $(STAMP)
	@echo "make install-dev: the dev tools (pytest, ruff, pyright, Triton, ...) for make test and make lint"
	$(PY) -m pip install -e '.[dev]'
	touch $@

run: $(STAMP)
	$(VENV)/bin/kvscope serve $(if $(PORT),--port $(PORT))

pull: $(STAMP)
	$(VENV)/bin/kvscope pull

# The formatter's check, the linter (line length included), the type checker (paths and mode in pyproject.toml
# [tool.pyright]), the dashboards' generated JSON, the generated Kubernetes deployment (deploy/kubernetes/), the
# import contracts. .pre-commit-config.yaml runs the same.
# PYRIGHT_PYTHON_IGNORE_WARNINGS: the pyright wrapper skips asking PyPI for a newer version (works offline).
LINT_PATHS := engine gateway kernels kvscope dashboards bench tests

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright
	$(PY) -P -m kvscope.dashboards.generate --check
	$(PY) -P -m kvscope.deploy.generate --check
	$(VENV)/bin/lint-imports

# test-artifacts/ (git-ignored) keeps each run's reports, written whether the run passed or not: junit.xml
# (every test's outcome and seconds, setup and teardown included; xunit1: with each test's file) and
# durations.txt (wall time, machine, the slowest files and tests: scripts/test_durations.py reads junit.xml).
# The files sharing the hf_model fixture run on one worker (tests/xdist_groups.py).
test: $(DEV_STAMP) pull lint
	mkdir -p test-artifacts
	$(PY) -P -m pytest -n $(TEST_WORKERS) --dist loadfile --junitxml=test-artifacts/junit.xml \
	  -o junit_family=xunit1 $(PYTEST_ARGS); status=$$?; \
	$(PY) -P scripts/test_durations.py test-artifacts/junit.xml --workers $(TEST_WORKERS) \
	  > test-artifacts/durations.txt && head -n 3 test-artifacts/durations.txt; exit $$status

# The fresh-machine check: a clone of HEAD with empty HOME, TMPDIR and model cache, then .ci/run (CI=true).
test-fresh:
	bash .ci/test-fresh

bench: $(STAMP) pull
	$(VENV)/bin/kvscope bench --offline

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache test-artifacts

# The two commands a newcomer runs (see README): `make up` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: up test test-fast lint docs docs-serve bench clean

# Test modules run on this many pytest-xdist workers (a module's tests stay on one: they share its servers).
TEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,dev]'
	touch $@

## Set up and start the embedded default cluster (SmolLM2 on two llama.cpp replicas, gateway on :8000).
up: $(VENV)/.installed
	$(BIN)/corral up

## Set up everything the tests need (engines, model files, services), then run the whole suite.
test: $(VENV)/.installed-test
	bash scripts/test-services.sh
	$(BIN)/corral prepare -f tests/data/cluster.yaml
	$(BIN)/corral prepare -f tests/data/vllm-cluster.yaml
	$(BIN)/corral prepare -f tests/data/vllm-ray-cluster.yaml
	$(PYTEST)

## The inner loop: unit and simulator tests only (no real engine, Ray, NGINX, Prometheus or Chromium).
test-fast: $(VENV)/.installed-test
	bash scripts/test-services.sh
	$(PYTEST) -m 'not slow'

lint: $(VENV)/.installed-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy src

## The documentation site from docs/ into site/ (strict: a missing page or a broken link fails the build).
docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

## The same site on http://127.0.0.1:8001, rebuilt as pages change.
docs-serve: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict --dev-addr 127.0.0.1:8001

$(VENV)/.installed-bench: pyproject.toml $(VENV)/.installed-test
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,dev,bench]'
	touch $@

bench: $(VENV)/.installed-bench
	$(BIN)/python benchmarks/gateway_overhead.py

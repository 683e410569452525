# kubestrata: `make up` starts a local federation, `make test` runs everything.
# Both set themselves up on a fresh machine: virtualenv, Python packages, and the
# Kubernetes control planes built from Go modules (cached in ~/.cache/kubestrata).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
ARGS   ?=

.PHONY: up down venv build-k8s lint test test-unit test-e2e bench clean

up: venv build-k8s
	$(BIN)/kubestrata up $(ARGS)

down: venv
	$(BIN)/kubestrata down $(ARGS)

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kubestrata needs Python 3.11 or newer, found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

build-k8s:
	hack/k8s/build.sh all

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test-unit: venv
	$(BIN)/pytest tests/unit

test-e2e: venv build-k8s
	$(BIN)/pytest tests/e2e

test: lint build-k8s
	$(BIN)/pytest tests

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache

# kubestrata: `make up` starts a local federation, `make test` runs everything.
# Both set themselves up on a fresh machine: virtualenv, Python packages, and the
# Kubernetes control planes built from Go modules (cached in ~/.cache/kubestrata).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
ARGS   ?=

.PHONY: up down venv build-k8s proto proto-check lint test test-unit test-e2e bench clean

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

# The estimator's gRPC code, generated from its .proto by the pinned grpcio-tools and
# mypy-protobuf; proto-check (part of lint) fails when the checked-in code differs.
PROTO := kubekit/estimatorapi/estimator.proto
PROTOC = PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m grpc_tools.protoc -I . \
	--python_out=$(1) --grpc_python_out=$(1) --mypy_out=$(1) --mypy_grpc_out=$(1) $(PROTO)

proto: venv
	$(call PROTOC,.)

proto-check: venv
	@tmp=$$(mktemp -d) && $(call PROTOC,$$tmp) && \
	  diff -r -x '*.proto' -x '__init__.py' -x '__pycache__' $$tmp/kubekit/estimatorapi kubekit/estimatorapi \
	  && rm -rf $$tmp || { echo "generated estimator code is stale: run make proto"; exit 1; }

lint: venv proto-check
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

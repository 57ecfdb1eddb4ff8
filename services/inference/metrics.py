"""Prometheus metrics of the inference service (names after TGI/vLLM, `llmesh_` prefix, base units).

Gauges move by inc/dec so that several engines in one process (during a model switch) add up.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from llmesh.metrics import LATENCY_BUCKETS

TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)

#: Every value the `outcome` label takes.
OUTCOMES = (
    "stop",
    "length",
    "stop_sequence",
    "cancelled",
    "rejected_queue_full",
    "queue_timeout",
    "invalid",
    "error",
)

QUEUE_SIZE = Gauge("llmesh_inference_queue_size", "Requests waiting for a batch slot.")
BATCH_SIZE = Gauge("llmesh_inference_batch_size", "Sequences in the running decode batch.")
TIME_TO_FIRST_TOKEN = Histogram(
    "llmesh_inference_time_to_first_token_seconds",
    "Time from a request's arrival to its first generated token.",
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "llmesh_inference_inter_token_latency_seconds",
    "Time between two consecutive tokens of one sequence.",
    buckets=TOKEN_LATENCY_BUCKETS,
)
REQUEST_DURATION = Histogram(
    "llmesh_inference_request_duration_seconds",
    "Time from a request's arrival to its last token.",
    buckets=LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter("llmesh_inference_prompt_tokens", "Prompt tokens prefilled.")
GENERATION_TOKENS = Counter("llmesh_inference_generation_tokens", "Tokens generated.")
REQUESTS = Counter("llmesh_inference_requests", "Generation requests by outcome.", ["outcome"])
OOM_RETRIES = Counter(
    "llmesh_inference_oom_retries", "Device out-of-memory errors answered by halving the batch and retrying."
)
KV_BLOCKS_FREE = Gauge(
    "llmesh_inference_kv_blocks_free", "KV blocks an allocation can take (free, or cached and held by no sequence)."
)
PREFIX_CACHED_BLOCKS = Gauge("llmesh_inference_prefix_cached_blocks", "KV blocks registered in the prefix cache.")
PREFIX_QUERY_TOKENS = Counter(
    "llmesh_inference_prefix_query_tokens", "Prompt tokens looked up in the prefix cache (at admission)."
)
PREFIX_HIT_TOKENS = Counter(
    "llmesh_inference_prefix_hit_tokens",
    "Prompt tokens served from the prefix cache (hit rate: this over llmesh_inference_prefix_query_tokens).",
)
PREFIX_EVICTIONS = Counter(
    "llmesh_inference_prefix_evictions", "Cached KV blocks evicted (least recently used) to make room."
)

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


for _outcome in OUTCOMES:
    REQUESTS.labels(_outcome)
for _reason in RETRY_REASONS:
    BACKEND_RETRIES.labels(_reason)

MULTIPLEX_BATCH_UPDATES = Histogram(
    "llmesh_inference_multiplex_batch_updates",
    "Updates (tokens or endings of generations) carried by one Inference.GenerateMany message.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)

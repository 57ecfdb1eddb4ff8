"""Prometheus metrics of a generation (names after TGI/vLLM, `llmesh_` prefix, base units): the
builtin engine's own (queue, batch, KV blocks, prefix cache, preemptions) and the per-request ones
every backend of the inference service reports the same way (time to first token, durations,
tokens, outcomes).

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

MODEL_SERVED = Gauge(
    "llmesh_inference_model_served",
    "Engines loaded, by model, version, the dtype it serves in and its weight quantization "
    "(LLMESH_DTYPE, LLMESH_QUANTIZE: what auto chose).",
    ["model", "version", "dtype", "quantization"],
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
PREEMPTIONS = Counter(
    "llmesh_inference_preemptions",
    "Running sequences requeued to give their KV blocks or row to others, by why.",
    ["reason"],
)
#: Every value the preemption `reason` label takes: the KV pool ran out, or a request of a
#: higher priority needed a batch row's room.
PREEMPTION_REASONS = ("kv_blocks", "priority")
PREFIX_EVICTIONS = Counter(
    "llmesh_inference_prefix_evictions", "Cached KV blocks evicted (least recently used) to make room."
)

for _outcome in OUTCOMES:
    REQUESTS.labels(_outcome)
for _reason in PREEMPTION_REASONS:
    PREEMPTIONS.labels(_reason)

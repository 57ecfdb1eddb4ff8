"""Gateway metrics (Prometheus naming: base units, `_total` counters, one `llmesh_` prefix)."""

from prometheus_client import Counter, Gauge, Histogram

from llmesh.metrics import LATENCY_BUCKETS

REQUESTS = Counter(
    "llmesh_gateway_requests", "Generate requests by outcome, cache tier and model.", ["outcome", "cache_tier", "model"]
)
REQUEST_DURATION = Histogram(
    "llmesh_gateway_request_duration_seconds",
    "End-to-end latency of Generate requests (exemplars carry the trace id).",
    ["cache_tier", "model"],
    buckets=LATENCY_BUCKETS,
)
ADMISSION_WEIGHT = Gauge("llmesh_gateway_admission_weight", "Request weight admitted in the current window.")
ADMISSION_BUDGET = Gauge("llmesh_gateway_admission_budget", "Request weight the window admits at most.")
ADMISSION_IN_FLIGHT_LIMIT = Gauge(
    "llmesh_gateway_admission_in_flight_limit",
    "Weight in flight the gateway allows, learned from inference's measured throughput.",
)
ADMISSION_IN_FLIGHT = Gauge(
    "llmesh_gateway_admission_in_flight", "Weight admitted and not yet generated (as of the last admission)."
)
ADMISSION_THROUGHPUT = Gauge(
    "llmesh_gateway_admission_throughput", "Weight generated per second while busy, as the gateway measures it."
)
SHED = Counter("llmesh_gateway_shed", "Requests refused before any work, by reason.", ["reason"])
INGEST_BYTES_IN_FLIGHT = Gauge(
    "llmesh_gateway_ingest_bytes_in_flight",
    "Document bytes of the ingests running through this gateway (at most LLMESH_INGEST_MAX_BYTES_IN_FLIGHT).",
)
DEGRADED = Counter("llmesh_gateway_degraded", "Requests answered with a part left out, by what.", ["what"])
# `peer` is the breaker's whole name (`inference/NAME:info`); `service`, `model` and `method`
# are its parts, so a dashboard can group by model or leave the cheap calls' breakers out.
BREAKER_LABELS = ["peer", "service", "model", "method"]
BREAKER_STATE = Gauge(
    "llmesh_gateway_breaker_state",
    "Circuit breaker state per downstream and method (0 closed, 1 half-open, 2 open).",
    BREAKER_LABELS,
)
BREAKER_TRANSITIONS = Counter(
    "llmesh_gateway_breaker_transitions",
    "Circuit breaker state changes.",
    [*BREAKER_LABELS, "from_state", "to_state"],
)
HTTP_REQUESTS = Counter(
    "llmesh_gateway_http_requests",
    "Requests to the OpenAI-compatible HTTP API by route, method and status.",
    ["route", "method", "status"],
)
HTTP_DURATION = Histogram(
    "llmesh_gateway_http_request_duration_seconds",
    "Latency of HTTP API requests until the last byte of the response (streams included).",
    ["route"],
    buckets=LATENCY_BUCKETS,
)
HTTP_DISCONNECTS = Counter(
    "llmesh_gateway_http_disconnects",
    "Non-streaming HTTP requests whose client went away before the answer (the generation was cancelled).",
)
# A model's replicas (labels: the model's route name, "default" for the unnamed one,
# and the replica's address).
REPLICAS = Gauge("llmesh_gateway_replicas", "Replicas known per model (listed, or resolved from DNS).", ["model"])
REPLICA_EJECTED = Gauge(
    "llmesh_gateway_replica_ejected", "1 while a replica is ejected as an outlier, else 0.", ["model", "replica"]
)
REPLICA_EJECTIONS = Counter(
    "llmesh_gateway_replica_ejections", "Outlier ejections by reason.", ["model", "replica", "reason"]
)
REPLICA_REQUESTS = Counter(
    "llmesh_gateway_replica_requests", "Generate attempts sent to each replica.", ["model", "replica"]
)
REPLICA_RETRIES = Counter(
    "llmesh_gateway_replica_retries",
    "Generate calls retried on another replica before their first token, by why.",
    ["model", "reason"],
)
AFFINITY = Counter(
    "llmesh_gateway_prefix_affinity",
    "Picks by where the prompt's prefix was: hit (sent to the replica holding it), overloaded "
    "(that replica was above the load bound), miss (sent elsewhere), none (nobody held it).",
    ["model", "outcome"],
)
CACHE_LOOKUP_BATCH = Histogram(
    "llmesh_gateway_cache_lookup_batch_size",
    "Lookups each cache lookup call carried (_count: calls, _sum: lookups).",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)

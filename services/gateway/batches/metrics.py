"""Batch metrics. Lines per second is the rate of `llmesh_gateway_batch_lines_total`; the share of
engine time on batch work is `rate(llmesh_gateway_batch_line_seconds_total)` over the requests'
`rate(llmesh_gateway_request_duration_seconds_sum)` (a batch line is one of those requests)."""

from prometheus_client import Counter, Gauge

BATCHES = Gauge("llmesh_gateway_batches", "Batch jobs not yet ended, by status (as this gateway last saw).", ["status"])
BATCHES_ENDED = Counter("llmesh_gateway_batches_ended", "Batch jobs this gateway finalized, by status.", ["status"])
LINES = Counter(
    "llmesh_gateway_batch_lines",
    "Batch lines this gateway ran, by outcome (ok, error; retried: refused for load and given back).",
    ["outcome"],
)
LINE_SECONDS = Counter(
    "llmesh_gateway_batch_line_seconds", "Seconds batch lines spent in the request path (ok and error)."
)
LINES_RUNNING = Gauge("llmesh_gateway_batch_lines_running", "Batch lines this gateway runs now.")
LINES_TARGET = Gauge(
    "llmesh_gateway_batch_lines_target", "Batch lines this gateway may run at once now (halved on each refusal)."
)

"""Prometheus metrics: the per-service HTTP endpoint and the gRPC server metrics every service
exports (names after go-grpc-prometheus so existing dashboards work)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from llmesh.telemetry import current_trace_id

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

GRPC_STARTED = Counter(
    "grpc_server_started", "RPCs started on the server.", ["grpc_type", "grpc_service", "grpc_method"]
)
GRPC_HANDLED = Counter(
    "grpc_server_handled",
    "RPCs completed on the server, regardless of success or failure.",
    ["grpc_type", "grpc_service", "grpc_method", "grpc_code"],
)
GRPC_HANDLING = Histogram(
    "grpc_server_handling_seconds",
    "Response latency of RPCs handled by the server.",
    ["grpc_type", "grpc_service", "grpc_method"],
    buckets=LATENCY_BUCKETS,
)
# What the health service says, as metrics, so alerts need no gRPC probe.
SERVING = Gauge(
    "llmesh_serving", "1 while the service reports SERVING on its health service, 0 while warming up or draining."
)
# How late the event loop runs a timer: time every request on it waits before its handler runs.
EVENT_LOOP_LAG = Histogram(
    "llmesh_event_loop_lag_seconds",
    "How late the service's event loop woke a periodic timer (a busy or blocked loop delays every request).",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
DEPENDENCY_UP = Gauge(
    "llmesh_dependency_up",
    "1 while a backing store the service uses answers, 0 while it is unreachable (the service's health details).",
    ["dependency"],
)

# `llmesh up`'s own metrics, on a registry of their own: its endpoint must not show the service
# metrics above (llmesh_serving 0 of a process that serves nothing would raise an alert).
SUPERVISOR_REGISTRY = CollectorRegistry()
SUPERVISOR_RESTARTS = Counter(
    "llmesh_supervisor_restarts",
    "Service processes `llmesh up` started again after they exited on their own (a crash, the OOM killer).",
    ["service"],
    registry=SUPERVISOR_REGISTRY,
)


#: The label value that caller-chosen names past a metric's bound share.
OTHER_LABEL = "_other"


class BoundedLabels:
    """Label values for names callers choose (collections, tenants): the first `limit` distinct
    names keep their own value, later ones share OTHER_LABEL, so a metric's series stay bounded
    however many names callers make up (each series costs memory on every scrape and in Prometheus)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.named: set[str] = set()

    def __call__(self, name: str) -> str:
        if name in self.named:
            return name
        if len(self.named) < self.limit:
            self.named.add(name)
            return name
        return OTHER_LABEL


def trace_exemplar() -> dict[str, str] | None:
    """Exemplar labels linking a histogram sample to its trace (shown on OpenMetrics scrapes)."""
    trace_id = current_trace_id()
    return {"trace_id": trace_id} if trace_id else None


class MetricsEndpoint:
    """The /metrics HTTP server of one process."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry = REGISTRY) -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

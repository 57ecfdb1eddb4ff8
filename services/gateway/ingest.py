"""An ingest's admission at the gateway (no gRPC here).

Ingests cost retrieval's CPU (tokenizing, embedding) and memory, not an engine's rows, so the
inference admission window does not weigh them. Instead each gateway lets at most
LLMESH_INGEST_MAX_BYTES_IN_FLIGHT bytes of documents ingest at once: an ingest's weight is its
documents' bytes (the work grows with them). One that does not fit is refused
RESOURCE_EXHAUSTED (`INGEST_BUSY`) with a retry delay from the rate ingests have been running at;
one heavier than the whole budget runs when nothing else does. The caller's key limits (requests,
tokens) apply before this, as for a generation (services/gateway/usage.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from llmesh.errors import ResourceExhausted
from services.gateway import metrics

REASON_BUSY = "INGEST_BUSY"
# Document bytes an ingest runs through per second before one has been measured: retrieval's
# ingest benchmark embeds about 160 chunks/s of 48 tokens (stride 40) on two cores, some 25 KB
# of text a second.
INITIAL_BYTES_PER_SECOND = 25_000.0
# Weight of a new measurement in the learned rate.
RATE_SMOOTHING = 0.3
MIN_RETRY_S = 1.0
MAX_RETRY_S = 60.0


class IngestBudget:
    """Document bytes in flight through this gateway's ingests, at most `capacity`."""

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self.rate = INITIAL_BYTES_PER_SECOND
        self._clock = clock

    @contextlib.contextmanager
    def admit(self, nbytes: int) -> Iterator[None]:
        """Holds `nbytes` (at most the whole budget) while the ingest runs; ResourceExhausted
        when they do not fit beside the ingests in flight."""
        weight = min(nbytes, self.capacity)
        if self.in_flight and self.in_flight + weight > self.capacity:
            # Until enough of what is in flight has gone, at the rate ingests have run at.
            wait = (self.in_flight + weight - self.capacity) / self.rate
            retry_after = min(MAX_RETRY_S, max(MIN_RETRY_S, wait))
            metrics.SHED.labels(REASON_BUSY).inc()
            raise ResourceExhausted(
                f"this gateway is ingesting {self.in_flight} bytes of documents; {weight} more do not fit its "
                f"budget of {self.capacity} (LLMESH_INGEST_MAX_BYTES_IN_FLIGHT); retry in {retry_after:.0f}s",
                retry_after=retry_after,
                reason=REASON_BUSY,
                metadata={"in_flight_bytes": str(self.in_flight), "budget_bytes": str(self.capacity)},
            )
        self.in_flight += weight
        metrics.INGEST_BYTES_IN_FLIGHT.set(self.in_flight)
        started = self._clock()
        try:
            yield
            elapsed = self._clock() - started
            if nbytes and elapsed > 0:
                self.rate += RATE_SMOOTHING * (nbytes / elapsed - self.rate)
        finally:
            self.in_flight -= weight
            metrics.INGEST_BYTES_IN_FLIGHT.set(self.in_flight)

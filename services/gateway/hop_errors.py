"""How a failed downstream call reaches the gateway: the error that carries the peer's status,
and which statuses say the peer is unhealthy. Peers and the replica router both raise and judge
these, so they live below both."""

from __future__ import annotations

import grpc

from llmesh.errors import LlmeshError
from services.gateway.breaker import BreakerOpen


class PeerCallError(LlmeshError):
    """Raised for a failed downstream call; `cause` keeps the peer's status for relaying."""

    def __init__(self, cause: LlmeshError) -> None:
        super().__init__(cause.message, reason=cause.reason, metadata=cause.metadata)
        self.cause = cause
        self.code = cause.code

    def trailing_metadata(self) -> list[tuple[str, str | bytes]]:
        return self.cause.trailing_metadata()


# Codes that say the downstream is unhealthy; others (bad input, overload pushback) are its
# healthy answers and do not count against its breaker.
BREAKER_FAILURE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
)


# A downstream that failed, or whose breaker is open: optional hops degrade on these.
DOWNSTREAM_ERRORS = (PeerCallError, BreakerOpen)

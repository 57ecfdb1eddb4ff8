"""Typed domain errors and their one mapping to gRPC status codes with google.rpc details.

Domain code raises these and knows nothing of gRPC; the server interceptor in
llmesh.server turns them into statuses. Anything else becomes INTERNAL with a generic
message while the traceback goes to the log.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

DOMAIN = "llmesh.dev"
STATUS_DETAILS_KEY = "grpc-status-details-bin"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class LlmeshError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, reason: str = "", metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.metadata = dict(metadata or {})
        # More trailing metadata for the caller (the gateway adds `server-timing` to sheds).
        self.extra_trailing: list[tuple[str, str]] = []

    def details(self) -> list[any_pb2.Any]:
        if not self.reason:
            return []
        info = error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN, metadata=self.metadata)
        return [_pack(info)]

    def trailing_metadata(self) -> list[tuple[str, str | bytes]]:
        status = status_pb2.Status(code=self.code.value[0], message=self.message, details=self.details())
        return [(STATUS_DETAILS_KEY, status.SerializeToString()), *self.extra_trailing]


# Bounds on what one error carries: a request with thousands of bad items must still get a
# status small enough for every client to read (gRPC caps trailing metadata at a few KiB).
MAX_VIOLATIONS = 10
MAX_FIELD_CHARS = 100
MAX_DESCRIPTION_CHARS = 200
MAX_MESSAGE_CHARS = 1000


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bounded(violations: list[tuple[str, str]]) -> list[tuple[str, str]]:
    kept = [(_clip(f, MAX_FIELD_CHARS), _clip(d, MAX_DESCRIPTION_CHARS)) for f, d in violations[:MAX_VIOLATIONS]]
    if len(violations) > MAX_VIOLATIONS:
        kept.append(("", f"and {len(violations) - MAX_VIOLATIONS} more problems"))
    return kept


class InvalidArgument(LlmeshError):
    """Bad request fields; each violation is (field path, what is wrong)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, violations: Iterable[tuple[str, str]] | str, message: str = "") -> None:
        if isinstance(violations, str):
            violations = [("", violations)]
        self.violations = _bounded(list(violations))
        text = message or "; ".join(f"{f}: {d}" if f else d for f, d in self.violations)
        super().__init__(_clip(text, MAX_MESSAGE_CHARS), reason="INVALID_ARGUMENT")

    def details(self) -> list[any_pb2.Any]:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in self.violations
            ]
        )
        return [_pack(bad), *super().details()]


class ResourceExhausted(LlmeshError):
    """Overload: come back after retry_after seconds."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(
        self, message: str, *, retry_after: float, reason: str = "OVERLOADED", metadata: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message, reason=reason, metadata=metadata)
        self.retry_after = max(0.0, retry_after)

    def details(self) -> list[any_pb2.Any]:
        return [_pack(retry_info(self.retry_after)), *super().details()]

    def trailing_metadata(self) -> list[tuple[str, str | bytes]]:
        pushback = str(max(1, math.ceil(self.retry_after * 1000)))
        return [*super().trailing_metadata(), (RETRY_PUSHBACK_KEY, pushback)]


class Unavailable(LlmeshError):
    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, *, reason: str = "UNAVAILABLE", retry_after: float | None = None) -> None:
        super().__init__(message, reason=reason)
        self.retry_after = retry_after

    def details(self) -> list[any_pb2.Any]:
        extra = [_pack(retry_info(self.retry_after))] if self.retry_after is not None else []
        return [*extra, *super().details()]


class NotFound(LlmeshError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(LlmeshError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(LlmeshError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(LlmeshError):
    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceeded(LlmeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(LlmeshError):
    code = grpc.StatusCode.CANCELLED


class PeerError(LlmeshError):
    """A downstream service answered with an error; relayed with its code and details intact."""

    def __init__(self, peer: str, code: grpc.StatusCode, message: str, status_bin: bytes | None) -> None:
        super().__init__(f"{peer}: {message}")
        self.peer = peer
        self.code = code
        self._status_bin = status_bin

    def violations(self) -> list[tuple[str, str]]:
        """The field violations (google.rpc.BadRequest) the peer named, if any."""
        if not self._status_bin:
            return []
        bad = unpack_details(status_pb2.Status.FromString(self._status_bin)).get("bad_request")
        if not isinstance(bad, error_details_pb2.BadRequest):
            return []
        return [(v.field, v.description) for v in bad.field_violations]

    def trailing_metadata(self) -> list[tuple[str, str | bytes]]:
        if self._status_bin:
            status = status_pb2.Status.FromString(self._status_bin)
            status.message = self.message
            return [(STATUS_DETAILS_KEY, status.SerializeToString())]
        return super().trailing_metadata()


# The HTTP status of each code (google.rpc's HTTP mapping): the gateway's HTTP API answers
# typed errors with these, as the gRPC API answers them with the codes.
HTTP_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNAUTHENTICATED: 401,
}


def retry_after_of(exc: LlmeshError) -> float | None:
    """Seconds the caller should wait before retrying, when the error says (sheds, open breakers,
    a downstream's pushback relayed in its status details)."""
    value = getattr(exc, "retry_after", None)
    if value is not None:
        return float(value)
    info = unpack_details(status_details(exc.trailing_metadata())).get("retry_info")
    if isinstance(info, error_details_pb2.RetryInfo):
        return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


def retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    whole = int(seconds)
    return error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    )


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def status_details(metadata: Iterable[tuple[str, str | bytes]] | None) -> status_pb2.Status | None:
    """The google.rpc.Status carried in trailing metadata, if any."""
    for key, value in metadata or ():
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            return status_pb2.Status.FromString(value)
    return None


def unpack_details(status: status_pb2.Status | None) -> dict[str, object]:
    """Details by kind: 'bad_request', 'retry_info', 'error_info'."""
    found: dict[str, object] = {}
    if status is None:
        return found
    for detail in status.details:
        for name, cls in (
            ("bad_request", error_details_pb2.BadRequest),
            ("retry_info", error_details_pb2.RetryInfo),
            ("error_info", error_details_pb2.ErrorInfo),
        ):
            if detail.Is(cls.DESCRIPTOR):
                msg = cls()
                detail.Unpack(msg)
                found[name] = msg
    return found


def from_rpc_error(peer: str, err: grpc.aio.AioRpcError) -> LlmeshError:
    metadata = err.trailing_metadata() or ()
    status_bin = next((v for k, v in metadata if k == STATUS_DETAILS_KEY and isinstance(v, bytes)), None)
    return PeerError(peer, err.code(), err.details() or err.code().name, status_bin)


__all__ = [
    "HTTP_STATUS",
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "LlmeshError",
    "NotFound",
    "PeerError",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "code_pb2",
    "from_rpc_error",
    "retry_after_of",
    "status_details",
    "unpack_details",
]

"""Client channels to peer services: client spans (llmesh.rpc_tracing), retries on UNAVAILABLE for
idempotent methods (with a retry budget), and deadlines derived from the caller's."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from llmesh.rpc_tracing import TracedChannel
from llmesh.settings import RuntimeSettings

# The metadata key of the mesh credential (LLMESH_MESH_TOKEN), checked by llmesh.server's gate.
MESH_TOKEN_HEADER = "x-llmesh-mesh-token"

# Methods safe to retry: they change nothing, or setting the same value twice is harmless.
IDEMPOTENT_METHODS: dict[str, tuple[str, ...]] = {
    "llmesh.v1.Tokenizer": ("Encode", "Decode", "Count", "ApplyChatTemplate", "Chunk"),
    "llmesh.v1.Cache": ("Lookup", "Stats", "Invalidate"),
    "llmesh.v1.Retrieval": ("Search", "GetCollectionInfo", "Delete"),
    "llmesh.v1.Inference": ("GetModelInfo",),
}

# A deadline above this is "no deadline": grpc.aio reports a huge time_remaining() then.
NO_DEADLINE_THRESHOLD_S = 1e6


def service_config() -> str:
    names = [{"service": svc, "method": m} for svc, methods in IDEMPOTENT_METHODS.items() for m in methods]
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": names,
                    "retryPolicy": {
                        "maxAttempts": 3,
                        "initialBackoff": "0.05s",
                        "maxBackoff": "0.5s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ],
            # Retry budget: retries stop when more than half the recent calls failed, so
            # retries cannot multiply load during an outage.
            "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
        }
    )


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.service_config", service_config()),
        ("grpc.enable_retries", 1),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.lb_policy_name", "round_robin"),
        # A peer that restarts (`llmesh up` restarts a dead service on its port, Kubernetes a pod)
        # is dialled again within a second of coming back: gRPC's default backoff grows to 2 minutes.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


@dataclass(frozen=True)
class PeerAccess:
    """How a service proves itself to its peers: TLS credentials (mutual TLS) and the metadata
    every call carries (the mesh credential)."""

    credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] = ()


def peer_credentials(runtime: RuntimeSettings) -> grpc.ChannelCredentials | None:
    """TLS to peers when LLMESH_TLS_CA is set, presenting this service's own cert (mutual TLS)."""
    if not runtime.tls_ca:
        return None
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(runtime.tls_ca), read(runtime.tls_key), read(runtime.tls_cert))


def peer_access(runtime: RuntimeSettings) -> PeerAccess:
    """This service's access to its peers: its TLS identity, and LLMESH_MESH_TOKEN on every call."""
    token = runtime.mesh_token
    return PeerAccess(peer_credentials(runtime), ((MESH_TOKEN_HEADER, token),) if token else ())


def peer_channel(
    target: str,
    max_message_bytes: int = 8 * 1024 * 1024,
    access: PeerAccess | None = None,
    extra_options: Sequence[tuple[str, Any]] = (),
) -> TracedChannel:
    """A traced channel to a peer; round-robin over every address the target resolves to
    (`extra_options`: more channel arguments, e.g. a replica's reconnect backoff)."""
    access = access or PeerAccess()
    options = [*channel_options(max_message_bytes), *extra_options]
    if access.credentials is not None:
        channel = grpc.aio.secure_channel(target, access.credentials, options=options)
    else:
        channel = grpc.aio.insecure_channel(target, options=options)
    return TracedChannel(channel, access.metadata)


def remaining_seconds(context: grpc.aio.ServicerContext | None, default: float) -> float:
    """Time left for downstream calls: the caller's remaining deadline, or `default` when it set none."""
    if context is None:
        return default
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_THRESHOLD_S:
        return default
    return max(0.0, remaining)

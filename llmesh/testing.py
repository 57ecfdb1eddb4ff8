"""Test fixtures shared by the suite and the benchmarks: prepared real models, a tiny
random-weight model on the real tokenizer, and services hosted in-process on port 0."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

from llmesh import models
from llmesh.server import ServiceApp, ServiceHost
from llmesh.settings import Settings, load

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def real_models_dir() -> Path:
    """The prepared real models (SmolLM2, MiniLM), prepared on first use."""
    base = Path(os.environ.get("LLMESH_MODELS_DIR") or REPO_ROOT / ".data" / "models")
    models.prepare_all(base)
    return base


def build_tiny_model(models_dir: Path, name: str = "tiny", version: str = "v1", seed: int = 0) -> Path:
    """A 2-layer random-weight Llama on SmolLM2's real tokenizer, prepared like a real model
    (safetensors + manifest), so the loading and serving paths are the real ones."""
    root = models_dir / name
    target = root / version
    if (target / models.MANIFEST).is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    source = real_models_dir() / models.SMOLLM2 / "current"
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # Larger than Llama's 0.02: with tiny weights attention is nearly uniform and every prompt
        # yields the same repeated token, which would hide batching bugs (positions, KV rows).
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    target.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(target)
    for fname in TOKENIZER_FILES:
        shutil.copy2(source / fname, target / fname)
    models.write_manifest(target, f"tiny-random-llama-{seed}", {"generator": "llmesh.testing", "seed": seed})
    if not (root / "current").exists():
        models.point_current(root, version)
    return target


def free_port() -> int:
    """A loopback TCP port nothing listens on now (for a server that cannot bind port 0 itself)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def service_settings(service: str, env: Mapping[str, str] | None = None) -> Settings:
    """Settings for an in-process service on ephemeral ports."""
    merged = {
        **os.environ,
        "LLMESH_LISTEN": "127.0.0.1:0",
        "LLMESH_METRICS_PORT": "0",
        "LLMESH_HTTP_LISTEN": "127.0.0.1:0",
        **(env or {}),
    }
    return load(service, merged)


@contextlib.asynccontextmanager
async def hosted(
    service: str, factory: Callable[[Settings], ServiceApp], env: Mapping[str, str] | None = None
) -> AsyncIterator[ServiceHost]:
    """Runs one service in this event loop on port 0; yields the host (host.port, host.app)."""
    host = ServiceHost(factory(service_settings(service, env)), service_settings(service, env))
    await host.start()
    try:
        yield host
    finally:
        await host.stop(grace=1.0)


class OtlpReceiver:
    """A real OTLP/gRPC trace receiver on loopback (what Jaeger v2 listens for on 4317),
    keeping every span it is sent, for trace assertions across processes."""

    def __init__(self, keep_spans: bool = True) -> None:
        """keep_spans=False only counts spans (cheap: a benchmark's receiver must not compete
        with the load it measures)."""
        import threading
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self
        self.keep_spans = keep_spans
        self.count = 0
        self.spans: list[dict[str, object]] = []
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # notified on every export

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # type: ignore[no-untyped-def]
                receiver._collect(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _collect(self, request) -> None:  # type: ignore[no-untyped-def]
        from google.protobuf.json_format import MessageToDict

        if not self.keep_spans:
            n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            with self._lock:
                self.count += n
            return
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = {
                        a.key: MessageToDict(a.value).popitem()[1] if MessageToDict(a.value) else None
                        for a in span.attributes
                    }
                    found.append(
                        {
                            "service": resource.get("service.name", ""),
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "attributes": attributes,
                            "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        }
                    )
        with self._lock:
            self.spans.extend(found)
            self.count += len(found)
            self._arrived.notify_all()

    def wait_for(self, predicate: Callable[[list[dict[str, object]]], bool], timeout: float) -> bool:
        """Blocks until `predicate(spans)` holds (checked on every export) or `timeout` passes."""
        with self._arrived:
            return self._arrived.wait_for(lambda: predicate(self.spans), timeout)

    def trace(self, trace_id: str) -> list[dict[str, object]]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def close(self) -> None:
        self._server.stop(0)


class FakeClock:
    """A monotonic clock tests move by hand (for windows, breakers, timeouts)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

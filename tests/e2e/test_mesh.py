"""The whole mesh as five processes with the real models: a real answer, a cache hit, a
grounded answer from an ingested document, and one trace across all five services."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmesh.client import InvalidRequestError, Mesh
from llmesh.supervisor import Mesh as Processes
from llmesh.testing import OtlpReceiver, wait_until
from llmesh.v1 import common_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SERVICES = {"llmesh-gateway", "llmesh-tokenizer", "llmesh-inference", "llmesh-cache", "llmesh-retrieval"}
FACT = (
    "Zorblax Quint is the chief lighthouse keeper of the island of Vellmora. "
    "The lighthouse of Vellmora is painted bright purple and was built in 1873."
)


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    rx = OtlpReceiver()
    yield rx
    rx.close()


@pytest.fixture(scope="module")
def mesh(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver, module_redis_url: str
) -> Iterator[Processes]:
    data = tmp_path_factory.mktemp("mesh-data")
    env = {
        "LLMESH_DATA_DIR": str(data),
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_REDIS_URL": module_redis_url,
        "LLMESH_MAX_BATCH_SIZE": "8",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    with Processes(env=env) as procs:
        yield procs


@pytest.fixture(scope="module")
def client(mesh: Processes) -> Iterator[Mesh]:
    with Mesh(mesh.target("gateway"), timeout=300) as c:
        yield c


def wait_for_spans(receiver: OtlpReceiver, trace_id: str, caller_span: str, timeout: float = 15) -> list[dict]:
    """Spans of the trace once it is whole: every service and the gateway's entry span exported,
    every span's parent there too, and every gRPC call's server side there. A parent ends after its
    children and each process exports in order of ending, so what is still in a batch processor
    shows as a missing parent or a client span without its callee's span."""
    whole: list[dict] = []

    def complete(spans: list[dict]) -> bool:
        mine = [s for s in spans if s["trace_id"] == trace_id]
        by_id = {s["span_id"]: s for s in mine}
        if not SERVICES <= {s["service"] for s in mine} or not any(s["parent_span_id"] == caller_span for s in mine):
            return False
        if any(s["parent_span_id"] not in by_id for s in mine if s["parent_span_id"] != caller_span):
            return False
        callees = {(s["parent_span_id"], s["service"]) for s in mine}
        for s in mine:
            parent = by_id.get(str(s["parent_span_id"]))
            # A client span: an RPC span whose parent is in its own service (a server span's
            # parent is its caller's client span, in another service).
            if "rpc.system" in s["attributes"] and parent is not None and parent["service"] == s["service"]:
                if not any(p == s["span_id"] and svc != s["service"] for p, svc in callees):
                    return False
        whole[:] = mine  # taken under the receiver's lock: no export lands between check and copy
        return True

    receiver.wait_for(complete, timeout)
    return whole or receiver.trace(trace_id)


def test_real_answer_then_cache_hit(client: Mesh) -> None:
    first = client.ask("What is the capital of France?", max_new_tokens=48)
    assert "paris" in first.text.lower(), first.text
    assert not first.cache.hit
    assert first.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert first.usage.input_tokens > 10 and first.usage.output_tokens > 0
    assert len(first.trace_id) == 32
    # The store runs after the answer, in the background: an ask racing it is answered afresh
    # (and stored again). Each miss takes a whole generation, so three asks leave it ample time.
    answers = [first.text]
    for _ in range(3):
        second = client.ask("What is the capital of France?", max_new_tokens=48)
        if second.cache.hit:
            break
        answers.append(second.text)
    assert second.cache.hit and second.cache.tier == common_pb2.CACHE_TIER_EXACT
    assert second.text in answers
    assert second.trace_id != first.trace_id


def test_streaming_deltas_add_up_to_the_final_text(client: Mesh) -> None:
    deltas, final = [], None
    for message in client.stream("Name one primary color.", max_new_tokens=16, use_cache=False):
        if message.HasField("final"):
            final = message.final
        else:
            deltas.append(message.delta)
    assert final is not None and final.text and "".join(deltas) == final.text


def test_bad_input_gets_invalid_argument_with_fields(client: Mesh) -> None:
    with pytest.raises(InvalidRequestError) as info:
        client.ask("", temperature=5.0)
    fields = {f for f, _ in info.value.field_violations}
    assert {"prompt", "sampling.temperature"} <= fields


def test_ingested_fact_grounds_the_answer_in_one_trace(client: Mesh, receiver: OtlpReceiver) -> None:
    ingested = client.ingest([("vellmora-lighthouse", FACT)])
    assert ingested.documents == 1 and ingested.chunks >= 1
    found = client.search("Who keeps the Vellmora lighthouse?")
    assert found.results and found.results[0].document_id == "vellmora-lighthouse"
    # The caller's own trace continues into the mesh (W3C traceparent).
    caller_trace, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    traceparent = f"00-{caller_trace}-{caller_span}-01"
    answer = client.ask(
        "Who is the chief lighthouse keeper of Vellmora?", max_new_tokens=48, metadata=[("traceparent", traceparent)]
    )
    assert "zorblax" in answer.text.lower(), answer.text
    assert "vellmora-lighthouse" in {s.document_id for s in answer.sources}
    assert answer.trace_id == caller_trace
    spans = wait_for_spans(receiver, caller_trace, caller_span)
    assert SERVICES <= {s["service"] for s in spans}, {s["service"] for s in spans}
    entry = [s for s in spans if s["parent_span_id"] == caller_span]
    assert len(entry) == 1 and entry[0]["service"] == "llmesh-gateway", entry
    ids = {s["span_id"] for s in spans}
    orphans = [(s["service"], s["name"]) for s in spans if s is not entry[0] and s["parent_span_id"] not in ids]
    assert not orphans, orphans
    # The generation span has the GenAI attributes, with the true token counts.
    generation = [s for s in spans if s["name"] == "inference.generate"]
    assert len(generation) == 1, [s["name"] for s in spans]
    attrs = generation[0]["attributes"]
    assert int(attrs["gen_ai.usage.input_tokens"]) == answer.usage.input_tokens
    assert int(attrs["gen_ai.usage.output_tokens"]) == answer.usage.output_tokens
    assert attrs["gen_ai.request.model"] == "SmolLM2-135M-Instruct"
    assert int(attrs["gen_ai.request.max_tokens"]) == 48
    assert "gen_ai.response.finish_reasons" in attrs and "llmesh.batch.id" in attrs
    # ... and it is linked from the batch span it ran in.
    link = (caller_trace, generation[0]["span_id"])

    def linked(spans: list[dict]) -> list[dict]:
        return [s for s in spans if s["name"] == "inference.batch" and link in s["links"]]

    receiver.wait_for(lambda spans: bool(linked(spans)), 10)
    batches = linked(receiver.spans)
    assert batches, "no inference.batch span links to the request"
    assert batches[0]["attributes"]["llmesh.batch.id"]


def test_http_request_is_one_trace_through_every_hop(mesh: Processes, client: Mesh, receiver: OtlpReceiver) -> None:
    """The OpenAI-compatible HTTP API, called with the openai client: the caller's traceparent
    continues through the gateway's HTTP span into all five services."""
    import openai

    client.ingest([("vellmora-lighthouse", FACT)])
    caller_trace, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    base_url = mesh.procs["gateway"].http_base_url()
    with openai.OpenAI(base_url=base_url, api_key="unused", timeout=300, max_retries=0) as http:
        raw = http.chat.completions.with_raw_response.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "In which year was the lighthouse of Vellmora built?"}],
            max_tokens=32,
            extra_headers={"traceparent": f"00-{caller_trace}-{caller_span}-01"},
        )
    answer = raw.parse()
    assert answer.choices[0].message.content and raw.headers["x-trace-id"] == caller_trace
    assert "vellmora-lighthouse" in {s["document_id"] for s in answer.model_extra["llmesh"]["sources"]}  # type: ignore[index]
    spans = wait_for_spans(receiver, caller_trace, caller_span)
    assert SERVICES <= {s["service"] for s in spans}, {s["service"] for s in spans}
    entry = [s for s in spans if s["parent_span_id"] == caller_span]
    found = [(s["service"], s["name"], s["attributes"]) for s in entry]
    assert [f[:2] for f in found] == [("llmesh-gateway", "POST /v1/chat/completions")], found
    assert entry[0]["attributes"]["http.response.status_code"] in (200, "200")
    ids = {s["span_id"] for s in spans}
    orphans = [(s["service"], s["name"]) for s in spans if s is not entry[0] and s["parent_span_id"] not in ids]
    assert not orphans, orphans
    names = {s["name"] for s in spans}
    hops = {"llmesh.v1.Retrieval/Search", "llmesh.v1.Tokenizer/ApplyChatTemplate", "inference.generate"}
    assert hops <= names and any(n.startswith("llmesh.v1.Cache/Lookup") for n in names), names


EXPECTED_METRICS = {
    "gateway": {
        "llmesh_gateway_requests": "counter",
        "llmesh_gateway_request_duration_seconds": "histogram",
        "llmesh_gateway_admission_weight": "gauge",
        "llmesh_gateway_shed": "counter",
        "llmesh_gateway_breaker_state": "gauge",
        "llmesh_gateway_http_requests": "counter",
    },
    "inference": {
        "llmesh_inference_queue_size": "gauge",
        "llmesh_inference_batch_size": "gauge",
        "llmesh_inference_time_to_first_token_seconds": "histogram",
        "llmesh_inference_inter_token_latency_seconds": "histogram",
        "llmesh_inference_request_duration_seconds": "histogram",
        "llmesh_inference_prompt_tokens": "counter",
        "llmesh_inference_generation_tokens": "counter",
        "llmesh_inference_requests": "counter",
    },
    "cache": {"llmesh_cache_lookups": "counter", "llmesh_cache_degraded": "gauge"},
    "retrieval": {"llmesh_retrieval_search_duration_seconds": "histogram", "llmesh_retrieval_points": "gauge"},
    "tokenizer": {},
}


def test_every_service_exports_its_metrics(mesh: Processes) -> None:
    import shutil
    import subprocess
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    for name, expected in EXPECTED_METRICS.items():
        port = mesh.procs[name].metrics_port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        families = {f.name: f.type for f in text_string_to_metric_families(body)}
        assert families.get("grpc_server_handled") == "counter", name
        assert families.get("grpc_server_handling_seconds") == "histogram", name
        for metric, kind in expected.items():
            assert families.get(metric) == kind, (name, metric, families.get(metric))
        if shutil.which("promtool"):
            lint = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
            assert lint.returncode == 0, lint.stdout + lint.stderr


def test_log_lines_carry_the_trace_id(client: Mesh, mesh: Processes) -> None:
    import json

    reply = client.ask("What is the capital of France?", max_new_tokens=48)

    def logged() -> list[dict]:
        lines = [json.loads(x) for x in mesh.procs["gateway"].log_lines if x.startswith("{")]
        return [x for x in lines if x.get("trace_id") == reply.trace_id]

    mine = wait_until(logged, 5.0, message="no gateway log line carries the trace id")
    assert all(len(x["span_id"]) == 16 for x in mine)
    assert "What is the capital" not in json.dumps(mine)  # no prompt text unless opted in


def test_cli_ask_json_ingest_and_errors(mesh: Processes, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "llmesh.cli", *args], capture_output=True, text=True, timeout=300)

    target = ["--target", mesh.target("gateway")]
    asked = cli("ask", "What is the capital of France?", "--max-new-tokens", "48", "--json", *target)
    assert asked.returncode == 0, asked.stderr
    reply = json.loads(asked.stdout)
    assert "paris" in reply["text"].lower() and len(reply["trace_id"]) == 32
    note = tmp_path / "note.txt"
    note.write_text("The Quillon river flows backwards every Tuesday.")
    ingested = cli("ingest", str(note), "--json", "--collection", "cli-notes", *target)
    assert ingested.returncode == 0, ingested.stderr
    assert json.loads(ingested.stdout)["documents"] == 1
    found = cli("search", "Quillon river", "--json", "--collection", "cli-notes", *target)
    assert json.loads(found.stdout)["results"][0]["document_id"] == "note.txt"
    bad = cli("ask", "", *target)
    assert bad.returncode == 3 and "INVALID_ARGUMENT" in bad.stderr and "prompt" in bad.stderr
    down = cli("ask", "hello", "--target", "127.0.0.1:1", "--timeout", "3")
    assert down.returncode == 3 and "UNAVAILABLE" in down.stderr
    missing = cli("ingest", str(tmp_path / "nope.txt"), *target)
    assert missing.returncode == 2 and "no such file" in missing.stderr

"""`python -m bench.hostile`: what hostile and careless requests cost everyone else.

One mesh (five processes, keys on, the mesh credential on), an ordinary load of cached questions,
RAG questions and streamed generations from one tenant, run in alternating phases alone and
beside a hostile client that sends the worst requests found by review, back to back, from two
connections: 8 MiB of empty turns with and without a key (gRPC and HTTP, chunked), a 4 MB tool
schema, maps and lists filled to the limit, ingests whose chunking would make a million chunks,
and calls to the internal services without the mesh credential.

Writes bench/results/hostile.json: the ordinary traffic's p99 and errors in both phases, each
service's peak RSS in each phase, the gateway's event-loop lag p99, and how each hostile request
was answered and how fast.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import secrets
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import machine, percentile, print_table, write_result
from bench.harness.wire import f_bytes, f_varint
from bench.mesh import bench_mesh
from llmesh.supervisor import Mesh
from llmesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
)

ORDINARY_KEY = "ordinary-" + "o" * 24
HOSTILE_KEY = "hostile-" + "h" * 24
MB = 1024 * 1024
GRPC_MAX = 8 * MB
CACHED = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is two plus two?",
    "Which planet is known as the red planet?",
    "What do bees make?",
    "How many days are in a week?",
]
DOCUMENTS = [
    ("refunds", "Refunds are issued within 14 days of a return being received at our warehouse."),
    ("shipping", "Standard shipping takes three to five business days; express takes one day."),
    ("support", "Support is open on weekdays from 9am to 5pm Central European Time."),
    ("warranty", "Every device carries a two-year warranty covering manufacturing defects."),
]


# --- hostile requests, as raw bytes where the point is their wire size


def many_empty(number: int, size: int) -> bytes:
    """`size` bytes of empty elements of repeated field `number` (an empty turn, input...)."""
    return f_bytes(number, b"") * (size // 2)


def tool_schema_request(size: int) -> bytes:
    properties = ",".join(f'"p{i}":{{"type":"string","maxLength":{i % 50 + 1}}}' for i in range(size // 40))
    request = gateway_pb2.GenerateRequest(prompt="Call the tool.")
    request.tools.add(name="lookup", parameters='{"type":"object","properties":{' + properties + "}}")
    request.tool_choice.mode = "required"
    return request.SerializeToString()


def logit_bias_request() -> bytes:
    entries = b"".join(f_bytes(13, f_varint(1, i) + b"\x15\x00\x00\x80\x3f") for i in range(30_000))
    return gateway_pb2.GenerateRequest(prompt="hi").SerializeToString() + f_bytes(3, entries)


def long_tool_arguments_request() -> bytes:
    request = gateway_pb2.GenerateRequest()
    request.messages.add(role="user", content="What is the weather?")
    request.messages.add(role="assistant").tool_calls.add(
        id="call_1", name="weather", arguments='{"city":"' + "x" * 120_000 + '"}'
    )
    request.messages.add(role="tool", tool_call_id="call_1", content="sunny")
    return request.SerializeToString()


def ingest_request(chunk_tokens: int, overlap: int) -> bytes:
    text = ("lorem ipsum dolor sit amet " * 40_000)[: MB - 1024]
    request = gateway_pb2.IngestRequest(collection="hostile", chunk_tokens=chunk_tokens, overlap_tokens=overlap)
    request.documents.add(id="big", text=text)
    return request.SerializeToString()


def search_filter_request() -> bytes:
    entries = b"".join(f_bytes(6, f_bytes(1, f"k{i}".encode()) + f_bytes(2, b"v")) for i in range(6_000))
    return gateway_pb2.SearchRequest(query="refunds").SerializeToString() + entries


@dataclass
class Case:
    name: str
    expected: frozenset[str]
    send: Callable[[], Awaitable[str]]
    latencies: list[float] = field(default_factory=list)
    codes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Targets:
    gateway: str
    http: str
    cache: str
    inference: str

    @classmethod
    def of(cls, mesh: Mesh) -> Targets:
        return cls(
            mesh.target("gateway"),
            mesh.procs["gateway"].http_base_url(30),
            mesh.target("cache"),
            mesh.target("inference"),
        )


class Hostile:
    """The hostile client's requests against one mesh."""

    def __init__(self, targets: Targets) -> None:
        self.gateway = targets.gateway
        self.http = targets.http
        self.cache = targets.cache
        self.inference = targets.inference
        self.channel = grpc.aio.insecure_channel(self.gateway, options=[("grpc.max_send_message_length", GRPC_MAX)])
        self.internal = [grpc.aio.insecure_channel(t) for t in (self.cache, self.inference)]
        self.client = httpx.AsyncClient(timeout=60)
        keyed = (("authorization", f"Bearer {HOSTILE_KEY}"),)
        turns = many_empty(11, GRPC_MAX - 1024)
        body = b'{"model":"smollm2","messages":[' + b",".join([b"{}"] * (GRPC_MAX // 3)) + b"]}"
        schema = tool_schema_request(4 * MB)
        bias, arguments, search = logit_bias_request(), long_tool_arguments_request(), search_filter_request()
        inputs = many_empty(1, MB - 64)
        one_token, most_overlap = ingest_request(1, 0), ingest_request(8192, 8191)
        # A key past its budget of invalid calls is refused on its headers (LLMESH_INVALID_CALLS_PER_MINUTE).
        invalid = frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"})
        unauthenticated = frozenset({"UNAUTHENTICATED"})
        self.cases = [
            Case("grpc_8mib_empty_turns_no_key", unauthenticated, lambda: self._raw("Generate", turns, ())),
            Case("grpc_8mib_empty_turns_keyed", invalid, lambda: self._raw("Generate", turns, keyed)),
            Case("grpc_stream_8mib_empty_turns_keyed", invalid, lambda: self._raw("GenerateStream", turns, keyed)),
            Case("grpc_4mb_tool_schema", invalid, lambda: self._raw("Generate", schema, keyed)),
            Case("grpc_30k_logit_bias_entries", invalid, lambda: self._raw("Generate", bias, keyed)),
            Case("grpc_120kb_tool_call_arguments", invalid, lambda: self._raw("Generate", arguments, keyed)),
            Case("grpc_1mib_empty_embed_inputs", invalid, lambda: self._raw("Embed", inputs, keyed)),
            Case("grpc_6k_search_filter_keys", invalid, lambda: self._raw("Search", search, keyed)),
            Case("grpc_ingest_1mib_chunk_tokens_1", invalid, lambda: self._raw("Ingest", one_token, keyed)),
            Case("grpc_ingest_1mib_chunk_8192_overlap_8191", invalid, lambda: self._raw("Ingest", most_overlap, keyed)),
            Case("http_8mib_empty_turns_no_key_chunked", frozenset({"HTTP 401"}), lambda: self._http(body, False)),
            Case("http_8mib_empty_turns_keyed", frozenset({"HTTP 413", "HTTP 429"}), lambda: self._http(body, True)),
            Case("internal_cache_store_without_mesh_token", unauthenticated, self._plant),
            Case("internal_inference_without_mesh_token", unauthenticated, self._direct_inference),
        ]

    async def _raw(self, method: str, payload: bytes, metadata: Sequence[tuple[str, str]]) -> str:
        full = f"/llmesh.v1.Gateway/{method}"
        identity = lambda raw: raw  # noqa: E731
        try:
            if method == "GenerateStream":
                stream = self.channel.unary_stream(full, request_serializer=identity, response_deserializer=identity)
                async for _ in stream(payload, timeout=60, metadata=metadata):
                    pass
            else:
                unary = self.channel.unary_unary(full, request_serializer=identity, response_deserializer=identity)
                await unary(payload, timeout=60, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return "OK"

    async def _http(self, body: bytes, keyed: bool) -> str:
        headers = {"authorization": f"Bearer {HOSTILE_KEY}", "content-type": "application/json"} if keyed else {}

        async def chunks() -> Any:
            for start in range(0, len(body), 64 * 1024):
                yield body[start : start + 64 * 1024]

        try:
            reply = await self.client.post(
                f"{self.http}/chat/completions", content=body if keyed else chunks(), headers=headers
            )
        except httpx.HTTPError as exc:
            return type(exc).__name__
        return f"HTTP {reply.status_code}"

    async def _plant(self) -> str:
        scope = cache_pb2.CacheScope(tenant="ordinary", model="smollm2", collection="docs")
        store = cache_pb2.CacheStoreRequest(
            prompt=CACHED[0], scope=scope, answer=cache_pb2.CachedAnswer(text="planted by another process")
        )
        try:
            await cache_pb2_grpc.CacheStub(self.internal[0]).Store(store, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return "OK"

    async def _direct_inference(self) -> str:
        request = inference_pb2.InferenceRequest(text="hi", sampling=common_pb2.SamplingParams(max_new_tokens=4))
        try:
            async for _ in inference_pb2_grpc.InferenceStub(self.internal[1]).Generate(request, timeout=10):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return "OK"

    async def run(self, seconds: float) -> None:
        """One loop, each request sent as the last one was answered."""
        until = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < until:
            case = self.cases[i % len(self.cases)]
            started = time.perf_counter()
            code = await case.send()
            case.latencies.append(time.perf_counter() - started)
            case.codes[code] = case.codes.get(code, 0) + 1
            i += 1

    async def close(self) -> None:
        await self.channel.close()
        for channel in self.internal:
            await channel.close()
        await self.client.aclose()


async def _never_sent() -> str:
    raise AssertionError("a case rebuilt from a hostile process's results is not sent")


def hostile_process(targets: Targets, seconds: float, results: Any, nice: int = 0) -> None:
    """The hostile client, in a process of its own as a caller elsewhere would be: its sending
    never stalls the ordinary clients' loop. At niceness `nice`: on a machine whose cores the
    mesh shares with its load generators, the client's own work (building and pushing 8 MiB
    messages back to back) would otherwise be counted as what the mesh spends; a client on
    another host costs the mesh only what the mesh does with its requests. Puts
    {case: (latencies, codes, expected codes)} on `results`."""
    if nice:
        os.nice(nice)

    async def run() -> dict[str, tuple[list[float], dict[str, int], list[str]]]:
        hostile = Hostile(targets)
        try:
            await hostile.run(seconds)
        finally:
            await hostile.close()
        return {case.name: (case.latencies, case.codes, sorted(case.expected)) for case in hostile.cases}

    results.put(asyncio.run(run()))


# --- the ordinary load


@dataclass
class Ordinary:
    latencies: dict[str, list[float]] = field(default_factory=lambda: {"cached": [], "rag": [], "stream": []})
    errors: dict[str, int] = field(default_factory=dict)

    def all(self) -> list[float]:
        return [x for values in self.latencies.values() for x in values]


async def prepare(target: str) -> None:
    metadata = (("authorization", f"Bearer {ORDINARY_KEY}"),)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        ingest = gateway_pb2.IngestRequest(collection="kb")
        for doc_id, text in DOCUMENTS:
            ingest.documents.add(id=doc_id, text=text)
        await stub.Ingest(ingest, timeout=120, metadata=metadata)
        for prompt in CACHED:
            await stub.Generate(cached_request(prompt), timeout=120, metadata=metadata)


def cached_request(prompt: str) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt, use_retrieval=False, sampling=common_pb2.SamplingParams(max_new_tokens=16, temperature=0)
    )


async def ordinary_load(target: str, clients: int, until: float, into: Ordinary) -> None:
    metadata = (("authorization", f"Bearer {ORDINARY_KEY}"),)
    channels = [grpc.aio.insecure_channel(target) for _ in range(2)]
    stubs = [gateway_pb2_grpc.GatewayStub(c) for c in channels]

    async def client(i: int) -> None:
        stub, kind, n = stubs[i % 2], ("cached", "rag", "stream")[i % 3], 0
        while time.perf_counter() < until:
            started = time.perf_counter()
            try:
                if kind == "cached":
                    await stub.Generate(cached_request(CACHED[(i + n) % len(CACHED)]), timeout=60, metadata=metadata)
                elif kind == "rag":
                    request = gateway_pb2.GenerateRequest(
                        prompt=f"How long do refunds take? (ticket {i}-{n}-{secrets.token_hex(3)})",
                        use_cache=False,
                        collection="kb",
                        sampling=common_pb2.SamplingParams(max_new_tokens=8, temperature=0),
                    )
                    await stub.Generate(request, timeout=60, metadata=metadata)
                else:
                    request = gateway_pb2.GenerateRequest(
                        prompt=f"Write one line about the sea ({i}-{n}).",
                        use_cache=False,
                        use_retrieval=False,
                        sampling=common_pb2.SamplingParams(max_new_tokens=16, temperature=0),
                    )
                    async for _ in stub.GenerateStream(request, timeout=60, metadata=metadata):
                        pass
                into.latencies[kind].append(time.perf_counter() - started)
            except grpc.aio.AioRpcError as exc:
                into.errors[exc.code().name] = into.errors.get(exc.code().name, 0) + 1
            n += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    for channel in channels:
        await channel.close()


# --- what the services spent


def reset_peaks(mesh: Mesh) -> None:
    for sp in mesh.procs.values():
        with open(f"/proc/{sp.proc.pid}/clear_refs", "w") as refs:
            refs.write("5")


def peak_rss_mb(mesh: Mesh) -> dict[str, float]:
    peaks: dict[str, float] = {}
    for name, sp in mesh.procs.items():
        with open(f"/proc/{sp.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    peaks[name] = int(line.split()[1]) / 1024
    return peaks


def loop_lag_buckets(mesh: Mesh) -> dict[float, float]:
    port = mesh.procs["gateway"].metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "llmesh_event_loop_lag_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets[float(sample.labels["le"])] = sample.value
    return buckets


def lag_p99(before: dict[float, float], after: dict[float, float]) -> float:
    """The 99th percentile's bucket bound over the samples taken between two scrapes."""
    delta = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = delta[-1][1] if delta else 0.0
    for le, count in delta:
        if total and count >= 0.99 * total:
            return le
    return float("nan")


async def phase(mesh: Mesh, clients: int, seconds: float, hostile: bool, nice: int) -> dict[str, Any]:
    ordinary = Ordinary()
    reset_peaks(mesh)
    lag_before = loop_lag_buckets(mesh)
    sender = None
    if hostile:
        context = multiprocessing.get_context("spawn")
        answers = context.Queue()
        sender = (context.Process(target=hostile_process, args=(Targets.of(mesh), seconds, answers, nice)), answers)
        sender[0].start()
    gc.collect()
    gc.disable()  # the load generator's own pauses would count as the mesh's latency
    try:
        await ordinary_load(mesh.target("gateway"), clients, time.perf_counter() + seconds, ordinary)
    finally:
        gc.enable()
    found: dict[str, Any] = {}
    if sender is not None:
        found = await asyncio.to_thread(sender[1].get, True, seconds + 120)
        sender[0].join(30)
    return {
        "ordinary": ordinary,
        "rss": peak_rss_mb(mesh),
        "lag_p99": lag_p99(lag_before, loop_lag_buckets(mesh)),
        "hostile": found,
    }


async def measure(mesh: Mesh, clients: int, seconds: float, rounds: int, nice: int) -> dict[str, Any]:
    await prepare(mesh.target("gateway"))
    phases: dict[str, list[dict[str, Any]]] = {"alone": [], "with": []}
    for _ in range(rounds):
        phases["alone"].append(await phase(mesh, clients, seconds, False, nice))
        phases["with"].append(await phase(mesh, clients, seconds, True, nice))
    cases: dict[str, Case] = {}
    expected: dict[str, list[str]] = {}
    for run in phases["with"]:
        for name, (latencies, codes, wanted) in run["hostile"].items():
            case = cases.setdefault(name, Case(name, frozenset(wanted), _never_sent))
            expected[name] = wanted
            case.latencies += latencies
            for code, count in codes.items():
                case.codes[code] = case.codes.get(code, 0) + count
    result: dict[str, Any] = {}
    for name, runs in phases.items():
        latencies = [x for run in runs for x in run["ordinary"].all()]
        errors: dict[str, int] = {}
        for run in runs:
            for code, count in run["ordinary"].errors.items():
                errors[code] = errors.get(code, 0) + count
        result[f"normal_p99_s_{name}"] = percentile(latencies, 0.99)
        result[f"normal_p50_s_{name}"] = percentile(latencies, 0.5)
        result[f"normal_requests_{name}"] = len(latencies)
        result[f"normal_errors_{name}"] = errors
        for kind in ("cached", "rag", "stream"):
            values = [x for run in runs for x in run["ordinary"].latencies[kind]]
            result[f"normal_{kind}_p99_s_{name}"] = percentile(values, 0.99)
        result[f"rss_peak_mb_{name}"] = {
            service: max(run["rss"].get(service, 0.0) for run in runs) for service in runs[0]["rss"]
        }
        result[f"gateway_loop_lag_p99_s_{name}"] = max(run["lag_p99"] for run in runs)
    # Without the hostile client: the first phase only. A process keeps memory it was given (the
    # allocator's arenas), so every later "alone" phase starts where the hostile one left it.
    result["rss_peak_mb_alone_all_phases"] = result["rss_peak_mb_alone"]
    result["rss_peak_mb_alone"] = phases["alone"][0]["rss"]
    result["normal_p99_ratio"] = result["normal_p99_s_with"] / result["normal_p99_s_alone"]
    result["normal_errors"] = sum(result["normal_errors_alone"].values()) + sum(result["normal_errors_with"].values())
    result["gateway_rss_peak_ratio"] = result["rss_peak_mb_with"]["gateway"] / result["rss_peak_mb_alone"]["gateway"]
    result["hostile"] = {
        case.name: {
            "sent": len(case.latencies),
            "answered": case.codes,
            "expected": expected[case.name],
            "p50_ms": percentile(case.latencies, 0.5) * 1000,
            "p99_ms": percentile(case.latencies, 0.99) * 1000,
        }
        for case in cases.values()
    }
    result["hostile_sent"] = sum(len(c.latencies) for c in cases.values())
    result["hostile_per_second"] = result["hostile_sent"] / (seconds * rounds)
    result["hostile_unexpected"] = sum(
        n for case in cases.values() for code, n in case.codes.items() if code not in expected[case.name]
    )
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=6, help="ordinary clients (cached, RAG, stream in turn)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--rounds", type=int, default=2, help="alternating pairs of phases (alone, with)")
    parser.add_argument(
        "--hostile-nice", type=int, default=19, help="niceness of the hostile client's process (0: the mesh's own)"
    )
    parser.add_argument(
        "--invalid-calls-per-minute",
        type=int,
        default=None,
        help="LLMESH_INVALID_CALLS_PER_MINUTE for the mesh (0: every hostile request is received and refused)",
    )
    parser.add_argument("--name", default="hostile", help="result name (bench/results/NAME.json)")
    args = parser.parse_args(argv)
    env = {
        "LLMESH_API_KEYS": f"{ORDINARY_KEY}=ordinary;{HOSTILE_KEY}=hostile",
        "LLMESH_MESH_TOKEN": secrets.token_urlsafe(32),
    }
    if args.invalid_calls_per_minute is not None:
        env["LLMESH_INVALID_CALLS_PER_MINUTE"] = str(args.invalid_calls_per_minute)
    with bench_mesh(env) as mesh:
        result = asyncio.run(measure(mesh, args.clients, args.seconds, args.rounds, args.hostile_nice))
    result["settings"] = {
        "clients": args.clients,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "hostile_nice": args.hostile_nice,
        "invalid_calls_per_minute": env.get("LLMESH_INVALID_CALLS_PER_MINUTE", "default"),
    }
    result["passes"] = {
        "normal_p99_ratio<=1.2": result["normal_p99_ratio"] <= 1.2,
        "normal_errors==0": result["normal_errors"] == 0,
        "gateway_rss_peak_ratio<=1.5": result["gateway_rss_peak_ratio"] <= 1.5,
        "hostile_unexpected==0": result["hostile_unexpected"] == 0,
    }
    result["machine"] = machine()
    print_table({k: v for k, v in result.items() if not isinstance(v, dict)}, "bench.hostile")
    answered = {
        name: f"{case['answered']} p50 {case['p50_ms']:.1f} ms p99 {case['p99_ms']:.1f} ms"
        for name, case in result["hostile"].items()
    }
    print_table(answered, "hostile requests")
    print_table(result["passes"], "targets")
    print(json.dumps({"rss_alone": result["rss_peak_mb_alone"], "rss_with": result["rss_peak_mb_with"]}))
    print(f"wrote {write_result(args.name, result)}")


if __name__ == "__main__":
    main()

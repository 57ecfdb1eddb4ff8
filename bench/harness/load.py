"""The ordinary load: closed-loop gRPC clients asking cached, RAG and plain questions of the
gateway (which may be restarted on its port), each answer kept as an Outcome, and their summary."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.common import percentile
from llmesh.errors import status_details, unpack_details
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

LOST_GRACE_S = 5.0  # a request with no reply nor status this long after its deadline is lost
CLIENT_OPTIONS = [
    # Reconnect quickly to a restarted gateway: recovery should measure the mesh, not client backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
TENANT = "bench"
FAQ = "faq"  # never ingested: cached and plain requests look it up, find it empty, go on without context
DOCS = "docs"

CACHED_QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "What is a prime number?",
    "How do vaccines work?",
    "What causes the seasons on Earth?",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Name three renewable energy sources.",
    "What is the largest ocean?",
    "How do magnets work?",
    "What does a compiler do?",
    "How do bees make honey?",
)
DOCUMENTS = (
    ("vellmora", "Zorblax Quint is the chief lighthouse keeper of the island of Vellmora. The lighthouse is purple."),
    ("quorrin", "The Quorrin river floods every spring; the town of Dask built stone levees along it in 1911."),
    ("teshla", "Teshla bread is baked with blue corn flour and smoked salt, and is served at midwinter feasts."),
    ("marrowind", "The Marrowind railway links Ostrel to Penhallow in four hours through the Kerrig tunnels."),
    ("glimmerfin", "Glimmerfin trout glow faintly green at night and live only in the cold lakes of Ysmere."),
    ("orbek", "The Orbek observatory on Mount Tallis houses a 3-metre telescope built by Ilse Varga."),
)
RAG_QUESTIONS = (
    "Who is the lighthouse keeper of Vellmora?",
    "What colour is the Vellmora lighthouse?",
    "When were the levees on the Quorrin river built?",
    "What flour is Teshla bread baked with?",
    "How long does the Marrowind railway take from Ostrel to Penhallow?",
    "Where do glimmerfin trout live?",
    "Who built the telescope of the Orbek observatory?",
)
TOPICS = ("volcanoes", "tides", "owls", "glaciers", "bridges", "comets", "coral", "deserts", "rivers", "clouds")


def now() -> float:
    return time.perf_counter()


@dataclass
class Outcome:
    kind: str
    code: str  # OK, a gRPC status code name, NO_FINAL (stream ended without its final message) or LOST
    started: float
    ended: float
    retry_info: bool = False
    retry_after: float | None = None
    cache_hit: bool = False
    degradations: tuple[str, ...] = ()
    sources: int = 0
    weight: int = 0  # input tokens x requested max_new_tokens of an answer that was generated
    detail: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # the gateway's server-timing, ms per hop
    reason: str = ""  # google.rpc.ErrorInfo reason of a refusal (e.g. IN_FLIGHT_LIMIT)

    @property
    def latency(self) -> float:
        return self.ended - self.started

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    @property
    def shed(self) -> bool:
        return self.code == "RESOURCE_EXHAUSTED"

    @property
    def error(self) -> bool:
        return not (self.ok or self.shed)


class Load:
    """Closed-loop clients over a few channels to the gateway (which may be restarted on its port)."""

    def __init__(self, target: str, new_tokens: int, channels: int = 4) -> None:
        self.target = target
        self.new_tokens = new_tokens
        self.channels = [grpc.aio.insecure_channel(target, options=CLIENT_OPTIONS) for _ in range(channels)]
        self.stubs = [gateway_pb2_grpc.GatewayStub(c) for c in self.channels]
        self._counter = 0

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    def request(self, kind: str, rng: random.Random) -> gateway_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(max_new_tokens=self.new_tokens)
        if kind == "cached":
            return gateway_pb2.GenerateRequest(
                prompt=rng.choice(CACHED_QUESTIONS), sampling=sampling, collection=FAQ, tenant=TENANT
            )
        if kind == "rag":
            return gateway_pb2.GenerateRequest(
                prompt=rng.choice(RAG_QUESTIONS), sampling=sampling, collection=DOCS, tenant=TENANT, use_cache=False
            )
        if kind == "cached_rag":
            return gateway_pb2.GenerateRequest(
                prompt=rng.choice(RAG_QUESTIONS), sampling=sampling, collection=DOCS, tenant=TENANT
            )
        self._counter += 1
        prompt = f"Tell me one fact about {rng.choice(TOPICS)} (question {self._counter})."
        return gateway_pb2.GenerateRequest(
            prompt=prompt, sampling=sampling, collection=FAQ, tenant=TENANT, use_cache=False
        )

    async def call(
        self, kind: str, request: gateway_pb2.GenerateRequest, stream: bool, deadline: float, stub_index: int = 0
    ) -> Outcome:
        stub = self.stubs[stub_index % len(self.stubs)]
        started = now()

        timing: list[str] = []

        async def run() -> gateway_pb2.GenerateResponse | None:
            call: Any
            if not stream:
                call = stub.Generate(request, timeout=deadline)
                final = await call
            else:
                final = None
                call = stub.GenerateStream(request, timeout=deadline)
                async for message in call:
                    if message.HasField("final"):
                        final = message.final
            timing.extend(str(v) for k, v in (await call.trailing_metadata() or ()) if k == "server-timing")
            return final

        try:
            reply = await asyncio.wait_for(run(), deadline + LOST_GRACE_S)
        except TimeoutError:
            return Outcome(kind, "LOST", started, now())
        except grpc.aio.AioRpcError as err:
            ended = now()
            info = unpack_details(status_details(err.trailing_metadata()))
            retry = info.get("retry_info")
            retry_after = None
            if retry is not None:
                retry_after = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9  # type: ignore[attr-defined]
            shed_timing = [str(v) for k, v in (err.trailing_metadata() or ()) if k == "server-timing"]
            error_info = info.get("error_info")
            return Outcome(
                kind,
                err.code().name,
                started,
                ended,
                retry_info=retry is not None,
                retry_after=retry_after,
                detail=(err.details() or "")[:200],
                timings=parse_server_timing(shed_timing[0]) if shed_timing else {},
                reason=getattr(error_info, "reason", ""),
            )
        ended = now()
        if reply is None:
            return Outcome(kind, "NO_FINAL", started, ended)
        weight = 0 if reply.cache.hit else reply.usage.input_tokens * request.sampling.max_new_tokens
        return Outcome(
            kind,
            "OK",
            started,
            ended,
            cache_hit=reply.cache.hit,
            degradations=tuple(reply.degradations),
            sources=len(reply.sources),
            weight=weight,
            timings=parse_server_timing(timing[0]) if timing else {},
        )

    async def client(
        self,
        index: int,
        stop: asyncio.Event,
        sink: list[Outcome],
        mix: dict[str, float],
        deadline: float,
        pinned: bool = False,
    ) -> None:
        rng = random.Random(index * 7919 + 1)
        await asyncio.sleep(rng.random())  # users arrive spread over a second, not in one instant
        kinds, weights = list(mix), list(mix.values())
        while not stop.is_set():
            kind = kinds[index % len(kinds)] if pinned else rng.choices(kinds, weights)[0]
            stream = kind == "plain" and rng.random() < 0.5
            outcome = await self.call(kind, self.request(kind, rng), stream, deadline, index)
            sink.append(outcome)
            if outcome.shed:  # honour the pushback, capped so the run keeps pressure on the gateway
                await asyncio.sleep(min(outcome.retry_after or 0.1, 0.5) * rng.uniform(0.5, 1.0))
            elif outcome.error:
                await asyncio.sleep(rng.uniform(0.05, 0.1))

    async def run(
        self,
        clients: int,
        stop: asyncio.Event,
        sink: list[Outcome],
        mix: dict[str, float] | None = None,
        deadline: float = 15.0,
        pinned: bool = False,
    ) -> None:
        """`pinned`: client i asks only the i-th kind of the mix (round robin)."""
        mix = mix or {"cached": 0.4, "rag": 0.3, "plain": 0.3}
        with collection_paused():
            await asyncio.gather(*(self.client(i, stop, sink, mix, deadline, pinned) for i in range(clients)))

    async def for_seconds(self, clients: int, seconds: float, **kw: Any) -> tuple[list[Outcome], float]:
        sink: list[Outcome] = []
        stop = asyncio.Event()
        started = now()
        task = asyncio.create_task(self.run(clients, stop, sink, **kw))
        await asyncio.sleep(seconds)
        stop.set()
        await task
        return sink, now() - started


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No cyclic garbage collection in this process while the load runs (one pass afterwards).
    The load generator stands for callers on other machines: its full collections, over the
    thousands of outcomes a phase keeps, stopped every client for 0.16-0.19 s at a time here,
    and each such pause was counted as the mesh's latency (in a shed's p99 above all). The
    mesh's own services freeze their heap after warm-up for the same reason."""
    enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.unfreeze()
        gc.collect()


@contextlib.contextmanager
def process_niceness(niceness: int) -> Iterator[None]:
    """Runs this process (every thread: niceness is per thread on Linux) at `niceness`, then
    restores it. The load generator stands for callers on other machines: at a raised priority
    its own wait for a shared core is not counted as the mesh's latency. Without CAP_SYS_NICE
    it stays as it is."""
    tasks = Path("/proc/self/task")
    threads = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    before = {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in threads}
    try:
        for tid in threads:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except OSError:
        pass
    try:
        yield
    finally:
        for tid, value in before.items():
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, value)


async def loop_lag(stop: asyncio.Event, sink: list[float], interval: float = 0.01) -> None:
    """How late this process's event loop wakes up: the clients' own share of measured latency."""
    while not stop.is_set():
        t = now()
        await asyncio.sleep(interval)
        sink.append(now() - t - interval)


def parse_server_timing(value: str) -> dict[str, float]:
    """`cache;dur=0.8, inference;dur=412.3` -> {"cache": 0.8, "inference": 412.3}."""
    out = {}
    for part in value.split(","):
        name, _, dur = part.strip().partition(";dur=")
        try:
            out[name] = float(dur)
        except ValueError:
            continue
    return out


# The hops the gateway runs before admission: a request that is shed has paid for these.
PRE_ADMISSION_HOPS = ("model", "retrieval", "cache", "tokenizer")


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    shed = [o for o in outcomes if o.shed]
    errors = [o for o in outcomes if o.error and o.code != "LOST"]
    by_kind = {}
    for kind in ("cached", "rag", "plain"):
        mine = [o for o in outcomes if o.kind == kind]
        done = [o.latency for o in mine if o.ok]
        kind_shed = [o.latency for o in mine if o.shed]
        kind_in_gateway = [o.timings["total"] / 1000 for o in mine if o.shed and "total" in o.timings]
        # Refused downstream (the inference queue) rather than by the gateway's admission.
        kind_downstream = [o.latency for o in mine if o.shed and "total" not in o.timings]
        pre = [sum(o.timings.get(h, 0.0) for h in PRE_ADMISSION_HOPS) for o in mine if o.ok and o.timings]
        by_kind[kind] = {
            "requests": len(mine),
            "ok": len(done),
            "shed": len(kind_shed),
            "p50_s": round(percentile(done, 0.5), 4),
            "p99_s": round(percentile(done, 0.99), 4),
            "shed_p50_s": round(percentile(kind_shed, 0.5), 4),
            "shed_p99_s": round(percentile(kind_shed, 0.99), 4),
            "shed_in_gateway_p99_s": round(percentile(kind_in_gateway, 0.99), 4),
            "shed_downstream": len(kind_downstream),
            "shed_downstream_p50_s": round(percentile(kind_downstream, 0.5), 4),
            "pre_admission_p50_ms": round(percentile(pre, 0.5), 1),
            "pre_admission_p99_ms": round(percentile(pre, 0.99), 1),
        }
    by_kind["cached"]["hits"] = sum(o.cache_hit for o in outcomes if o.kind == "cached")
    by_kind["rag"]["grounded"] = sum(o.sources > 0 for o in outcomes if o.kind == "rag" and o.ok)
    latencies = [o.latency for o in ok]
    shed_times = [o.latency for o in shed]
    # The gateway's own time before each refusal (its server-timing `total`): the rest of a shed
    # reply's latency is spent before the handler runs (queues, a busy event loop) or in transit.
    shed_in_gateway = [o.timings["total"] / 1000 for o in shed if "total" in o.timings]
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "shed": len(shed),
        "other_errors": len(errors),
        "lost": sum(o.code == "LOST" for o in outcomes),
        "error_codes": dict(Counter(o.code for o in outcomes if o.error)),
        "error_examples": sorted({f"{o.code}: {o.detail}" for o in errors})[:5],
        "p50_s": round(percentile(latencies, 0.5), 4),
        "p99_s": round(percentile(latencies, 0.99), 4),
        "shed_p50_s": round(percentile(shed_times, 0.5), 4),
        "shed_p99_s": round(percentile(shed_times, 0.99), 4),
        "shed_in_gateway_p50_s": round(percentile(shed_in_gateway, 0.5), 4),
        "shed_in_gateway_p99_s": round(percentile(shed_in_gateway, 0.99), 4),
        "shed_without_retry_info": sum(not o.retry_info for o in shed),
        "capped": sum("max_new_tokens_capped" in o.degradations for o in ok),
        "degradations": dict(Counter(d for o in ok for d in o.degradations)),
        "by_kind": by_kind,
    }

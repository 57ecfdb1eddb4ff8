"""Reliability suite: the five services as processes under load, with faults and bad input.

    python -m bench.reliability [--quick] [--model tiny|smollm2] [--backend builtin|openai] [--duration 60]

Starts its own valkey-server (the embedded one) on a free port (so it can stop and start it), a temporary data dir
and the five services as separate processes on loopback (llmesh.supervisor.Mesh), then:

* load      64 concurrent grpc.aio clients in closed loop for --duration seconds (15 with
            --quick): repeated questions (cached), questions about ingested documents (RAG,
            use_cache=False) and unique questions (plain, use_cache=False, half of them streamed).
            The admission budget is set from a calibration run (a fraction of the weight the mesh
            completes per window) so that the gateway sheds. Counts ok / shed / other errors /
            lost (no reply nor status by the deadline + grace), latency percentiles and the p99 time
            to a shed reply; checks every shed reply carries google.rpc.RetryInfo.
* faults    each under 16 clients: inference SIGKILLed and restarted on the same port, retrieval
            likewise, the bench's Redis killed and restarted, inference stalled (SIGSTOP/SIGCONT),
            and SIGTERM to the gateway while long streams are in flight (they must finish within
            the drain grace; the gateway is then restarted on the same port). Per fault: errors,
            seconds to recover after the process is back (first success of an affected request and
            the breaker closed again, the later of the two), lost requests, breaker transitions
            scraped from the gateway's Prometheus endpoint, and which request kinds kept succeeding
            while the part was down.
* bad input every public gateway RPC with crafted raw protobuf bytes (empty, oversize, negative,
            NaN/inf, invalid UTF-8, wrong wire types, unknown fields, huge repeated fields) plus
            random bytes and mutations of valid requests; counts crashed processes and status
            codes other than INVALID_ARGUMENT / RESOURCE_EXHAUSTED / UNAUTHENTICATED (OK is fine
            for a request that happens to be valid).

With --backend openai the inference service fronts a real vLLM (CPU build, `make vllm`) serving
the prepared SmolLM2, and the faults add backend_freeze (vLLM's process group SIGSTOPped like the
other freezes); that run writes bench/results/reliability_openai.json.

The load, the bad inputs, the wire-format writer and the metric scrapes are the shared harness
(bench/harness/); this module holds the scenarios and their pass rules.

Writes bench/results/reliability.json (with "passes") and prints a table. The default run takes
about 8 minutes on 2 shared CPU cores (freezes and the default-budget phase included). The tiny
random-weight model is the default: the suite measures the mesh's behaviour, not model speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import grpc

from bench.common import machine, percentile, print_table, write_result
from bench.harness.bad_inputs import EXPECTED_BAD_INPUT_CODES, BadInput, crafted_inputs, random_inputs, send_raw
from bench.harness.load import (
    CLIENT_OPTIONS,
    DOCS,
    DOCUMENTS,
    FAQ,
    LOST_GRACE_S,
    RAG_QUESTIONS,
    TENANT,
    TOPICS,
    Load,
    Outcome,
    loop_lag,
    now,
    process_niceness,
    summarize,
)
from bench.harness.scrapes import BreakerWatch, bucket_quantile, gauge, histogram
from llmesh.supervisor import Mesh
from llmesh.testing import VLLM_MODEL_NAME, VllmServer, free_port
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc

SERVICES = ("tokenizer", "inference", "cache", "retrieval", "gateway")

BREAKER_WAIT_S = 2.0
GRACE_S = 5.0
ADMISSION_WINDOW_S = 5.0
SHED_FRACTION = 0.5  # admission budget = this x the weight the mesh completed per window in calibration
# The default-budget phase offers this many times the mesh's capacity: a fixed client
# count is within a fast machine's capacity and sheds nothing there.
DEFAULT_BUDGET_OVERLOAD = 4.0
ALL_KINDS = ("cached", "rag", "plain")
FREEZE_KINDS = ("cached", "cached_rag", "rag", "plain")
# Freezes run with cached RAG questions in the mix: their answers are cached for the last known
# collection version, so they must keep succeeding while retrieval is frozen.
# Each client asks one kind only (4 clients per kind with 16), so a kind's successes per second do
# not depend on how many clients happen to be waiting for slower kinds.
FREEZE_MIX = {"cached": 0.25, "cached_rag": 0.25, "rag": 0.25, "plain": 0.25}
FREEZES = ("retrieval_freeze", "cache_freeze", "tokenizer_freeze", "redis_freeze")
FAULTS = ("inference_kill", "retrieval_kill", "redis_stop", "inference_stall", "gateway_sigterm", *FREEZES)
# With --backend openai: the engine behind the inference service (vLLM) frozen, its process group
# SIGSTOPped as the other freezes.
BACKEND_FREEZE = "backend_freeze"
ALL_FREEZES = (*FREEZES, BACKEND_FREEZE)
FREEZE_RECOVERY_S = 2.0  # first success of an affected request after SIGCONT
# The hop each freeze stops: its recovery is also timed to the moment the hop answered the first
# affected request started after SIGCONT (that request's own generation after it is not
# recovery: on a loaded 2-core machine a vLLM answer takes seconds).
FROZEN_HOP = {
    "retrieval_freeze": "retrieval",
    "tokenizer_freeze": "tokenizer",
    "cache_freeze": "cache",
    "redis_freeze": "cache",
}


# --- the run -------------------------------------------------------------------------------------


@dataclass
class FaultResult:
    name: str
    t_inject: float = 0.0
    t_down: float = 0.0
    t_back: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


# Share of the default mix (cached 0.4, rag 0.3, plain 0.3) that reaches the engine.
GENERATION_SHARE = 0.6


async def engine_rows(inference_target: str, timeout: float = 10.0) -> int:
    """The engine's batch room as it reports it (Inference.WatchLoad's max_running): the
    requests it runs at once; 0 when it does not tell (an openai backend without the number)."""
    async with grpc.aio.insecure_channel(inference_target) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).WatchLoad(inference_pb2.WatchLoadRequest(), timeout=timeout)
        try:
            report = await call.read()
        except grpc.aio.AioRpcError:
            return 0
        finally:
            call.cancel()
    return int(getattr(report, "max_running", 0) or 0)


# The gateway's default LLMESH_ADMISSION_TARGET_SECONDS: a queue this long is admitted.
ADMISSION_TARGET_S = 3.0
# At most this many closed-loop clients (one event loop drives them all).
MAX_CLIENTS = 1024


def overload_clients(rows: int, generation_share: float, overload: float, requests_per_s: float | None = None) -> int:
    """Closed-loop clients that offer `overload` x the engine's capacity when a
    `generation_share` of them need the engine (the rest are cache hits): its rows, and, where
    the rate it completes requests at is measured, a queue `overload` x the admission target
    deep at that rate (a queue shorter than the target is served, not shed)."""
    generation = overload * rows
    if requests_per_s:
        generation = max(generation, rows + overload * ADMISSION_TARGET_S * requests_per_s)
    return min(MAX_CLIENTS, max(1, math.ceil(generation / max(generation_share, 1e-9))))


class Reliability:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="llmesh-reliability-"))
        self.redis_port = free_port()
        self.redis: subprocess.Popen[bytes] | None = None
        self.stopped: set[str] = set()  # processes the bench SIGSTOPped (resumed on exit)
        from llmesh.testing import build_tiny_model, real_models_dir

        models_dir = real_models_dir()
        if args.model == "tiny":
            build_tiny_model(models_dir)
        # --backend openai: inference fronts a real vLLM (CPU build) serving the prepared SmolLM2.
        self.vllm: VllmServer | None = None
        backend_env: dict[str, str] = {}
        if args.backend == "openai":
            self.vllm = VllmServer((models_dir / "smollm2" / "current").resolve(), self.tmp / "vllm.log")
            backend_env = {
                "LLMESH_INFERENCE_BACKEND": "openai",
                "LLMESH_BACKEND_URLS": self.vllm.base_url,
                "LLMESH_BACKEND_MODEL": VLLM_MODEL_NAME,
            }
        env = {
            "LLMESH_DATA_DIR": str(self.tmp / "data"),
            "LLMESH_MODELS_DIR": str(models_dir),
            "LLMESH_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "LLMESH_INFERENCE_MODEL": args.model,
            "LLMESH_BREAKER_WAIT_SECONDS": str(BREAKER_WAIT_S),
            "LLMESH_GRACE_SECONDS": str(GRACE_S),
            "LLMESH_ADMISSION_WINDOW_SECONDS": str(ADMISSION_WINDOW_S),
            "LLMESH_ADMISSION_TENANT_SHARE": "1",
            "LLMESH_ADMISSION_REDIS_URL": "",
            "LLMESH_LOG_LEVEL": os.environ.get("LLMESH_LOG_LEVEL", "WARNING"),
            "OTEL_EXPORTER_OTLP_ENDPOINT": "",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",
            **backend_env,
        }
        # The gateway is the front door: on shared cores it runs above everything else, as a
        # deployment gives it cores of its own (a CPU request, a cpuset); raising priority needs
        # CAP_SYS_NICE, so without it the gateway warns and runs at the default niceness.
        self.mesh = Mesh(env=env, service_env={"gateway": {"LLMESH_NICE": str(args.gateway_nice)}})
        self.load: Load | None = None
        #: Generation requests completed per second in calibration (None before it ran).
        self.calibrated_rate: float | None = None

    # -- processes

    def start_redis(self) -> None:
        # The embedded valkey-server (the mesh's own Redis), not whatever redis-server the host has.
        from llmesh.redis_server import server_binary

        self.redis = subprocess.Popen(
            [
                str(server_binary()),
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.tmp),
                "--protected-mode",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(port=self.redis_port, socket_timeout=0.5)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():
                    client.close()
                    return
            except redis.RedisError:
                pass
            if self.redis.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"valkey-server on port {self.redis_port} did not start")
            time.sleep(0.05)

    def kill_redis(self) -> None:
        if self.redis is not None and self.redis.poll() is None:
            self.redis.kill()
            self.redis.wait(10)

    def restart(self, name: str, **extra_env: str) -> None:
        """Starts `name` again on the port it had, so its peers find it."""
        self.mesh.start_one(name, extra_env={"LLMESH_METRICS_PORT": "0", **extra_env})

    def remember_ports(self) -> None:
        for name, proc in self.mesh.procs.items():
            self.mesh.ports[name] = proc.port

    def crashed(self) -> list[str]:
        return [n for n in SERVICES if n in self.mesh.procs and self.mesh.procs[n].proc.poll() is not None]

    def gateway_niceness(self) -> int | None:
        """The niceness the gateway process runs at (the 19th field of /proc/<pid>/stat)."""
        try:
            stat = Path(f"/proc/{self.mesh.procs['gateway'].proc.pid}/stat").read_text()
        except (KeyError, OSError):
            return None
        return int(stat.rpartition(")")[2].split()[16])

    def gateway_target(self) -> str:
        return self.mesh.target("gateway")

    def cleanup(self) -> None:
        for name in self.stopped:
            if name in self.mesh.procs:
                self.mesh.procs[name].proc.send_signal(signal.SIGCONT)
            elif name == "redis" and self.redis is not None:
                self.redis.send_signal(signal.SIGCONT)
            elif name == "backend" and self.vllm is not None:
                self.signal_backend(signal.SIGCONT)
        self.mesh.stop()
        if self.vllm is not None:
            self.vllm.stop()
        self.kill_redis()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- phases

    async def ingest(self) -> None:
        stub = gateway_pb2_grpc.GatewayStub(self.load.channels[0])  # type: ignore[union-attr]
        docs = [common_pb2.Document(id=i, text=t) for i, t in DOCUMENTS]
        await stub.Ingest(gateway_pb2.IngestRequest(collection=DOCS, tenant=TENANT, documents=docs), timeout=120)

    async def prime(self) -> None:
        """Answers every RAG question once with the cache on, so cached RAG requests hit."""
        assert self.load is not None
        stub = gateway_pb2_grpc.GatewayStub(self.load.channels[0])
        sampling = common_pb2.SamplingParams(max_new_tokens=self.args.new_tokens)
        requests = [
            gateway_pb2.GenerateRequest(prompt=question, sampling=sampling, collection=DOCS, tenant=TENANT)
            for question in RAG_QUESTIONS
        ]
        for request in requests:  # asked until the answer comes from the cache (shed, capped: again)
            for _ in range(40):
                try:
                    if (await stub.Generate(request, timeout=60)).cache.hit:
                        break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.5)

    async def calibrate(self, seconds: float) -> dict[str, Any]:
        assert self.load is not None
        outcomes, elapsed = await self.load.for_seconds(self.args.clients, seconds)
        done = [o for o in outcomes if o.ok and o.weight]
        rate = sum(o.weight for o in done) / max(elapsed, 1e-9)
        budget = max(1.0, round(SHED_FRACTION * rate * ADMISSION_WINDOW_S))
        return {
            "seconds": round(elapsed, 2),
            "requests": len(outcomes),
            "generated": len(done),
            "weight_per_s": round(rate, 1),
            "admission_budget": budget,
            "errors": sum(o.error for o in outcomes),
        }

    async def restart_gateway(self, **extra_env: str) -> None:
        await asyncio.to_thread(self.mesh.stop_one, "gateway")
        await asyncio.to_thread(self.restart, "gateway", **extra_env)
        if self.load is not None:  # the clients' channels reconnect before the next phase counts
            for channel in self.load.channels:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(channel.channel_ready(), 15)

    async def run_fault(
        self,
        name: str,
        inject: Callable[[FaultResult], Awaitable[None]],
        recovered: Callable[[Outcome], bool],
        peer: str | None,
        down_kinds: Sequence[str] = (),
        mix: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """One fault under load: warm up, inject (which restores and sets t_back), then run on until
        the affected requests succeed again (or the phase times out)."""
        assert self.load is not None
        args = self.args
        sink: list[Outcome] = []
        stop = asyncio.Event()
        watch = BreakerWatch(self.mesh)
        watch.start()
        task = asyncio.create_task(
            self.load.run(args.fault_clients, stop, sink, mix=mix, deadline=args.fault_deadline, pinned=mix is not None)
        )
        await asyncio.sleep(args.fault_warmup)
        result = FaultResult(name, t_inject=now())
        try:
            await inject(result)
        finally:
            if not result.t_back:
                result.t_back = now()
        end_at = result.t_inject + args.fault_seconds
        give_up = result.t_back + max(15.0, 4 * BREAKER_WAIT_S)
        while True:
            t = now()
            seen = any(recovered(o) and o.started >= result.t_back for o in sink)
            if t >= give_up or (t >= end_at and seen):
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # a few samples past recovery
        stop.set()
        await task
        await watch.stop()
        after = [o for o in sink if o.started >= result.t_back and recovered(o)]
        first_ok = min((o.ended for o in after), default=None)
        to_success = None if first_ok is None else round(first_ok - result.t_back, 3)
        to_closed = watch.closed_since(peer, result.t_back) if peer else 0.0
        recover = None if to_success is None or to_closed is None else round(max(to_success, to_closed), 3)
        during = [o for o in sink if o.ended >= result.t_inject]
        out: dict[str, Any] = {
            "requests": len(sink),
            "errors_during": sum(o.error for o in during),
            "error_codes": dict(Counter(o.code for o in during if o.error)),
            "shed": sum(o.shed for o in sink),
            "lost": sum(o.code == "LOST" for o in sink) + result.extra.get("streams_lost", 0),
            "down_seconds": round(result.t_back - result.t_down, 2) if result.t_down else None,
            "seconds_to_first_success": to_success,
            "seconds_to_breaker_closed": None if to_closed is None else round(to_closed, 3),
            "seconds_to_recover": recover,
            "breaker": peer,
            "breaker_opened": watch.opened(peer) if peer else False,
            "breaker_transitions": watch.transitions(),
            "error_examples": sorted({f"{o.code}: {o.detail}" for o in during if o.error})[:4],
        }
        if down_kinds:
            window = [o for o in sink if result.t_down <= o.started < result.t_back]
            kept: dict[str, Any] = {}
            for kind in down_kinds:
                mine = [o for o in window if o.kind == kind]
                kept[kind] = {
                    "requests": len(mine),
                    "ok": sum(o.ok for o in mine),
                    "errors": sum(o.error for o in mine),
                    "degradations": dict(Counter(d for o in mine if o.ok for d in o.degradations)),
                }
            out["while_down"] = kept
        not_degraded = [
            o.ended
            for o in sink
            if o.started >= result.t_back and o.ok and o.kind == "cached" and "cache_unavailable" not in o.degradations
        ]
        if name == "redis_stop":
            out["seconds_to_cache_not_degraded"] = round(min(not_degraded) - result.t_back, 3) if not_degraded else None
        if name in ALL_FREEZES:
            out.update(freeze_figures(sink, result, down_kinds))
        if name in FROZEN_HOP:
            hop = FROZEN_HOP[name]
            answered = [
                o.started + sum(ms for k, ms in o.timings.items() if k not in ("inference", "total")) / 1000
                for o in after
                if hop in o.timings
            ]
            out["seconds_to_hop_answered"] = round(min(answered) - result.t_back, 3) if answered else None
        out.update(result.extra)
        if args.dump is not None:
            self.dump(name, sink, watch, result)
        return out

    def dump(self, name: str, sink: Sequence[Outcome], watch: BreakerWatch, fault: FaultResult) -> None:
        """Every request of a fault and the breaker samples, times relative to the fault's start
        (`t_down`), for looking at where the time went (--dump DIR)."""
        t0 = fault.t_down or fault.t_inject
        self.dump_requests(
            name,
            sink,
            t0,
            t_back=round(fault.t_back - t0, 3),
            breakers=[(round(ts - t0, 3), states) for ts, states in watch.samples],
            admission=[(round(ts - t0, 3), gauges) for ts, gauges in watch.admission],
        )

    def dump_requests(self, name: str, sink: Sequence[Outcome], t0: float, **extra: Any) -> None:
        """Every request of a phase (--dump DIR/<name>.json), times relative to `t0`."""
        self.args.dump.mkdir(parents=True, exist_ok=True)
        requests = [
            {
                "kind": o.kind,
                "code": o.code,
                "reason": o.reason,
                "start": round(o.started - t0, 4),
                "latency": round(o.latency, 4),
                "degradations": list(o.degradations),
                "hit": o.cache_hit,
                "retry_after": o.retry_after,
                "detail": o.detail if not (o.ok or o.shed) else "",
                "timings": o.timings,
            }
            for o in sink
        ]
        (self.args.dump / f"{name}.json").write_text(json.dumps({**extra, "requests": requests}) + "\n")

    async def fault_freeze(self, name: str, result: FaultResult) -> None:
        """SIGSTOP for --freeze-seconds, then SIGCONT: the process is there, and answers nothing.
        Before freezing retrieval, every RAG question's answer is cached for the current version."""
        if name == "retrieval":
            await self.prime()
        proc = self.redis if name == "redis" else self.mesh.procs[name].proc
        assert proc is not None
        await self._pause(name, proc.send_signal, self.args.freeze_seconds, result)

    async def _pause(
        self, name: str, send: Callable[[signal.Signals], None], seconds: float, result: FaultResult
    ) -> None:
        """SIGSTOP through `send`, `seconds`, then SIGCONT (cancelled too); `name` stays in
        `stopped` meanwhile, so cleanup resumes it whatever happens."""
        self.stopped.add(name)
        send(signal.SIGSTOP)
        result.t_down = now()
        try:
            await asyncio.sleep(seconds)
        finally:
            send(signal.SIGCONT)
            self.stopped.discard(name)
        result.t_back = now()

    def signal_backend(self, sig: signal.Signals) -> None:
        """To vLLM's whole process group: its API server and its engine core."""
        assert self.vllm is not None and self.vllm.process is not None
        os.killpg(self.vllm.process.pid, sig)

    async def fault_backend_freeze(self, result: FaultResult) -> None:
        await self._pause("backend", self.signal_backend, self.args.freeze_seconds, result)

    async def fault_kill(self, name: str, result: FaultResult) -> None:
        await asyncio.to_thread(self.mesh.stop_one, name, 10.0, signal.SIGKILL)
        result.t_down = now()
        await asyncio.sleep(self.args.down_seconds)
        await asyncio.to_thread(self.restart, name)
        result.t_back = now()

    async def fault_redis(self, result: FaultResult) -> None:
        await asyncio.to_thread(self.kill_redis)
        result.t_down = now()
        await asyncio.sleep(self.args.down_seconds + 2)
        await asyncio.to_thread(self.start_redis)
        result.t_back = now()

    async def fault_stall(self, result: FaultResult) -> None:
        await self._pause("inference", self.mesh.procs["inference"].proc.send_signal, self.args.stall_seconds, result)

    async def fault_gateway(self, result: FaultResult) -> None:
        """SIGTERM to the gateway while long streams are in flight; they must finish in the grace."""
        assert self.load is not None
        streams = self.args.long_streams
        first_delta = [asyncio.Event() for _ in range(streams + 1)]
        finished: list[tuple[str, float, int]] = []

        async def long_stream(i: int, tokens: int) -> None:
            request = gateway_pb2.GenerateRequest(
                prompt=f"Write a long story about {TOPICS[i % len(TOPICS)]} number {i}.",
                sampling=common_pb2.SamplingParams(max_new_tokens=tokens, ignore_eos=True),
                collection=FAQ,
                tenant=TENANT,
                use_cache=False,
            )
            stub = self.load.stubs[i % len(self.load.stubs)]  # type: ignore[union-attr]
            deltas, code = 0, "NO_FINAL"
            deadline = 60.0
            try:
                async with asyncio.timeout(deadline + LOST_GRACE_S):
                    async for message in stub.GenerateStream(request, timeout=deadline):
                        if message.HasField("final"):
                            code = "OK"
                        else:
                            deltas += 1
                            first_delta[i].set()
            except TimeoutError:
                code = "LOST"
            except grpc.aio.AioRpcError as err:
                code = err.code().name
            first_delta[i].set()
            finished.append((code, now(), deltas))

        # This fault is about the drain, not admission: the learned in-flight limit would shed the
        # long streams on a slow machine, so it is off until the gateway is restarted after it.
        await self.restart_gateway(LLMESH_ADMISSION_ADAPTIVE="false")
        # Size the streams to the speed under this load: long enough to be cut by the SIGTERM, short
        # enough to finish inside the grace period (about 0.4 of it after their first token).
        probe_tokens = 64
        t = now()
        await long_stream(streams, probe_tokens)
        per_token = (now() - t) / probe_tokens
        tokens = max(32, min(512, int(0.4 * GRACE_S / max(per_token, 1e-4))))
        finished.clear()
        tasks = [asyncio.create_task(long_stream(i, tokens)) for i in range(streams)]
        try:
            async with asyncio.timeout(30):
                for event in first_delta:
                    await event.wait()
        except TimeoutError:
            pass
        in_flight = streams - len(finished)
        result.t_inject = sigterm_at = now()
        rc = await asyncio.to_thread(self.mesh.stop_one, "gateway", GRACE_S + 20)
        result.t_down = exited = now()
        await asyncio.gather(*tasks)
        await asyncio.to_thread(self.restart, "gateway")
        result.t_back = now()
        done_in_time = [f for f in finished if f[0] == "OK" and f[1] - sigterm_at <= GRACE_S]
        result.extra.update(
            {
                "streams_in_flight_at_sigterm": in_flight,
                "streams_completed": sum(f[0] == "OK" for f in finished),
                "streams_completed_within_grace": len(done_in_time),
                "stream_codes": dict(Counter(f[0] for f in finished)),
                "streams_lost": sum(f[0] == "LOST" for f in finished),
                "stream_tokens": tokens,
                "probe_seconds_per_token": round(per_token, 5),
                "stream_deltas_min": min((f[2] for f in finished), default=0),
                "last_stream_end_after_sigterm_s": round(
                    max((f[1] for f in finished), default=sigterm_at) - sigterm_at, 3
                ),
                "drain_seconds": round(exited - sigterm_at, 3),
                "gateway_exit_code": rc,
                "grace_seconds": GRACE_S,
            }
        )

    async def faults(self, which: Sequence[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        plan: list[
            tuple[str, Callable[[FaultResult], Awaitable[None]], Callable[[Outcome], bool], str | None, tuple[str, ...]]
        ] = [
            (
                "inference_kill",
                lambda r: self.fault_kill("inference", r),
                lambda o: o.ok and o.kind in ("plain", "rag") and not o.cache_hit,
                "inference",
                ALL_KINDS,
            ),
            (
                "retrieval_kill",
                lambda r: self.fault_kill("retrieval", r),
                lambda o: o.ok and o.kind == "rag" and "retrieval_unavailable" not in o.degradations,
                "retrieval",
                ALL_KINDS,
            ),
            (
                "redis_stop",
                self.fault_redis,
                lambda o: o.ok and o.kind == "cached" and o.cache_hit and "cache_unavailable" not in o.degradations,
                "cache",
                ALL_KINDS,
            ),
            (
                "inference_stall",
                self.fault_stall,
                lambda o: o.ok and o.kind in ("plain", "rag") and not o.cache_hit,
                "inference",
                ALL_KINDS,
            ),
            ("gateway_sigterm", self.fault_gateway, lambda o: o.ok, None, ()),
            (
                "retrieval_freeze",
                lambda r: self.fault_freeze("retrieval", r),
                lambda o: o.ok and o.kind == "rag" and "retrieval_unavailable" not in o.degradations,
                "retrieval",
                FREEZE_KINDS,
            ),
            (
                "cache_freeze",
                lambda r: self.fault_freeze("cache", r),
                lambda o: o.ok and o.kind == "cached" and o.cache_hit and "cache_unavailable" not in o.degradations,
                "cache",
                FREEZE_KINDS,
            ),
            (
                "tokenizer_freeze",
                lambda r: self.fault_freeze("tokenizer", r),
                lambda o: o.ok and o.kind == "plain" and "tokenizer_estimate" not in o.degradations,
                "tokenizer",
                FREEZE_KINDS,
            ),
            (
                "redis_freeze",
                lambda r: self.fault_freeze("redis", r),
                lambda o: o.ok and o.kind == "cached" and o.cache_hit and "cache_unavailable" not in o.degradations,
                "cache",
                FREEZE_KINDS,
            ),
            (
                BACKEND_FREEZE,
                self.fault_backend_freeze,
                lambda o: o.ok and o.kind in ("plain", "rag") and not o.cache_hit,
                "inference",
                FREEZE_KINDS,
            ),
        ]
        for name, inject, recovered, peer, kinds in plan:
            if name not in which:
                continue
            print(f"fault: {name}", flush=True)
            mix = FREEZE_MIX if name in ALL_FREEZES else None
            result = await self.run_fault(name, inject, recovered, peer, kinds, mix)
            if name == "retrieval_kill":
                result["rag_grounded_after_restart"] = await self.grounded()
            crashed = self.crashed()
            result["crashed_after"] = crashed
            out[name] = result
            if crashed:
                for dead in crashed:  # keep the run going; the crash is reported
                    self.mesh.procs.pop(dead)
                    await asyncio.to_thread(self.restart, dead)
        return out

    async def grounded(self) -> bool:
        """Whether the documents ingested before the retrieval kill are still found."""
        stub = gateway_pb2_grpc.GatewayStub(self.load.channels[0])  # type: ignore[union-attr]
        try:
            found = await stub.Search(
                gateway_pb2.SearchRequest(query=RAG_QUESTIONS[0], collection=DOCS, tenant=TENANT), timeout=10
            )
        except grpc.aio.AioRpcError:
            return False
        return any(r.document_id == "vellmora" for r in found.results)

    async def bad_input(self) -> dict[str, Any]:
        crafted = crafted_inputs(heavy=True)
        inputs = crafted + random_inputs(max(0, self.args.bad_inputs - len(crafted)), random.Random(7))
        channel = grpc.aio.insecure_channel(self.gateway_target(), options=CLIENT_OPTIONS)
        semaphore = asyncio.Semaphore(16)
        codes: Counter[str] = Counter()
        unexpected: list[dict[str, str]] = []
        unexpected_kinds: Counter[str] = Counter()
        started = now()

        async def one(item: BadInput) -> None:
            async with semaphore:
                code, details = await send_raw(channel, item, self.args.bad_input_deadline)
            if code == "RESOURCE_EXHAUSTED" and "metadata size exceeds" in details:
                # Not a shed: the client dropped an error status too large for its metadata limit.
                code = "RESOURCE_EXHAUSTED_STATUS_TOO_LARGE"
            codes[code] += 1
            if code not in EXPECTED_BAD_INPUT_CODES:
                kind = f"{item.method.rsplit('/', 1)[1]} {item.label} -> {code}"
                unexpected_kinds[kind] += 1
                if unexpected_kinds[kind] == 1:
                    unexpected.append(
                        {
                            "method": item.method,
                            "case": item.label,
                            "code": code,
                            "details": details[:200],
                            "payload_head_hex": item.payload[:24].hex(),
                        }
                    )

        try:
            await asyncio.gather(*(one(item) for item in inputs))
        finally:
            await channel.close()
        crashed = self.crashed()
        by_label = Counter(k.rsplit(" -> ", 1)[1] for k in unexpected_kinds.elements())
        return {
            "bad_inputs_tried": len(inputs),
            "crafted": len(crafted),
            "seconds": round(now() - started, 1),
            "crashes": len(crashed),
            "crashed": crashed,
            "codes": dict(codes.most_common()),
            "unexpected_codes": sum(by_label.values()),
            "unexpected_by_code": dict(by_label),
            "unexpected_cases": len(unexpected),
            "unexpected_examples": unexpected[:40],
        }

    async def load_phase(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Calibrates, restarts the gateway with a budget that sheds, runs the load, restores the budget."""
        assert self.load is not None
        args = self.args
        # Calibration measures the mesh, not the gateway's learned limit: that one is off here
        # and in the calibrated load phase (the default_budget phase runs with it).
        await self.restart_gateway(LLMESH_ADMISSION_ADAPTIVE="false")
        calibration = await self.calibrate(args.calibrate_seconds)
        self.calibrated_rate = calibration["generated"] / max(calibration["seconds"], 1e-9)
        print(f"calibration: {calibration}", flush=True)
        budget = calibration["admission_budget"]
        await self.restart_gateway(LLMESH_ADMISSION_BUDGET=str(budget), LLMESH_ADMISSION_ADAPTIVE="false")
        print(f"load: {args.clients} clients for {args.duration:.0f}s", flush=True)
        stop, lags = asyncio.Event(), []
        lag_task = asyncio.create_task(loop_lag(stop, lags))
        lag_before = self.loop_lags()
        started = now()
        with process_niceness(args.client_nice):
            outcomes, elapsed = await self.load.for_seconds(args.clients, args.duration, deadline=args.deadline)
        stop.set()
        if args.dump is not None:
            self.dump_requests("load", outcomes, started)
        await lag_task
        lag_after = self.loop_lags()
        load = summarize(outcomes)
        load.update(
            {
                "clients": args.clients,
                "seconds": round(elapsed, 1),
                "requests_per_s": round(len(outcomes) / elapsed, 1),
                "admission_budget": budget,
                "client_loop_lag_p50_s": round(percentile(lags, 0.5), 4),
                "client_loop_lag_p99_s": round(percentile(lags, 0.99), 4),
                # Bucket upper bounds of each service's own loop lag (llmesh_event_loop_lag_seconds).
                "loop_lag_p99_le_s": {
                    name: bucket_quantile(lag_before.get(name, {}), after, 0.99) for name, after in lag_after.items()
                },
                "gateway_niceness": self.gateway_niceness(),
            }
        )
        await self.restart_gateway()  # the faults run with the default admission budget
        return calibration, load

    def loop_lags(self) -> dict[str, dict[float, float]]:
        """Each running service's event-loop lag histogram."""
        return {
            name: histogram(proc.metrics_port, "llmesh_event_loop_lag_seconds")
            for name, proc in self.mesh.procs.items()
            if proc.metrics_port
        }

    async def default_budget(self) -> dict[str, Any]:
        """The load phase on default settings (no calibrated budget), offered DEFAULT_BUDGET_OVERLOAD
        x the mesh's capacity: whether overload is shed rather than timed out."""
        assert self.load is not None
        args = self.args
        await self.restart_gateway()
        rows = await engine_rows(self.mesh.target("inference"))
        # Rows x the overload, not a queue sized from the calibrated rate: on 2 shared cores the
        # ~800 clients that asks for overload the client and the gateway themselves.
        clients = overload_clients(rows or args.clients, GENERATION_SHARE, DEFAULT_BUDGET_OVERLOAD)
        print(f"default budget: {clients} clients ({rows} engine rows) for {args.duration:.0f}s", flush=True)
        started = now()
        with process_niceness(args.client_nice):
            outcomes, elapsed = await self.load.for_seconds(clients, args.duration, deadline=args.deadline)
        if args.dump is not None:
            self.dump_requests("default_budget", outcomes, started)
        limit = gauge(self.mesh.procs["gateway"].metrics_port, "llmesh_gateway_admission_in_flight_limit")
        throughput = gauge(self.mesh.procs["gateway"].metrics_port, "llmesh_gateway_admission_throughput")
        out = summarize(outcomes)
        generated = [o for o in outcomes if o.ok and o.weight]
        out.update(
            {
                "clients": clients,
                "engine_rows": rows,
                "offered_over_capacity": DEFAULT_BUDGET_OVERLOAD,
                "seconds": round(elapsed, 1),
                "requests_per_s": round(len(outcomes) / elapsed, 1),
                "deadline_exceeded": sum(o.code == "DEADLINE_EXCEEDED" for o in outcomes),
                "generated_weight_per_s": round(sum(o.weight for o in generated) / max(elapsed, 1e-9), 1),
                "learned_in_flight_limit": limit,
                # The limit is measured throughput x LLMESH_ADMISSION_TARGET_SECONDS (3 s) / 2,
                # or more where first tokens stayed prompt (the carried weight).
                "learned_weight_per_s": None if throughput is None else round(throughput, 1),
                "default_window_budget": "LLMESH_ADMISSION_BUDGET default (cap only)",
            }
        )
        return out

    async def main(self) -> dict[str, Any]:
        args = self.args
        t0 = now()
        if self.vllm is not None:
            self.vllm.start()
            await asyncio.to_thread(self.vllm.wait_ready)
            print(f"vLLM up in {now() - t0:.1f}s", flush=True)
        await asyncio.to_thread(self.start_redis)
        await asyncio.to_thread(self.mesh.start)
        self.remember_ports()
        print(f"mesh up in {now() - t0:.1f}s (model {args.model})", flush=True)
        self.load = Load(self.gateway_target(), args.new_tokens)
        result: dict[str, Any] = {"model": args.model, "backend": args.backend, "quick": args.quick}
        try:
            await self.ingest()
            if "load" in args.only:
                result["calibration"], result["load"] = await self.load_phase()
            if "default_budget" in args.only:
                result["default_budget"] = await self.default_budget()
                if "calibration" in result:
                    result["default_budget"]["calibrated_budget"] = result["calibration"]["admission_budget"]
                    result["default_budget"]["calibrated_weight_per_s"] = result["calibration"]["weight_per_s"]
            if args.faults:
                result["faults"] = await self.faults(args.faults)
            if "bad_input" in args.only:
                print("bad input", flush=True)
                result["bad_input"] = await self.bad_input()
        finally:
            await self.load.close()
        result["config"] = {
            "clients": args.clients,
            "duration_s": args.duration,
            "deadline_s": args.deadline,
            "new_tokens": args.new_tokens,
            "fault_clients": args.fault_clients,
            "fault_seconds": args.fault_seconds,
            "fault_deadline_s": args.fault_deadline,
            "bad_input_deadline_s": args.bad_input_deadline,
            "down_seconds": args.down_seconds,
            "stall_seconds": args.stall_seconds,
            "freeze_seconds": args.freeze_seconds,
            "long_streams": args.long_streams,
            "gateway_nice": args.gateway_nice,
            "client_nice": args.client_nice,
            "breaker_wait_s": BREAKER_WAIT_S,
            "grace_s": GRACE_S,
            "admission_window_s": ADMISSION_WINDOW_S,
            "shed_fraction_of_capacity": SHED_FRACTION,
            "lost_grace_s": LOST_GRACE_S,
            "fault_admission_budget": "default settings (learned in-flight limit, LLMESH_ADMISSION_BUDGET=2e7 cap)",
        }
        result["wall_seconds"] = round(now() - t0, 1)
        result["machine"] = machine()
        result["passes"] = passes(result)
        return result


def passes(result: dict[str, Any]) -> dict[str, bool]:
    """The targets, for the parts that ran."""
    load, faults, bad = result.get("load"), result.get("faults", {}), result.get("bad_input")
    limit = 2 * BREAKER_WAIT_S
    out: dict[str, bool] = {
        "lost_zero_everywhere": (load is None or load["lost"] == 0) and all(f["lost"] == 0 for f in faults.values())
    }
    if load is not None:
        out.update(
            {
                "load_other_errors_zero": load["other_errors"] == 0,
                "load_sheds": load["shed"] > 0,
                "shed_replies_carry_retry_info": load["shed_without_retry_info"] == 0,
                "shed_reply_p99_le_50ms": load["shed"] > 0 and load["shed_p99_s"] <= 0.050,
            }
        )
    if bad is not None:
        out.update(
            {
                "bad_inputs_ge_1000": bad["bad_inputs_tried"] >= 1000,
                "bad_input_crashes_zero": bad["crashes"] == 0,
                "bad_input_unexpected_codes_zero": bad["unexpected_codes"] == 0,
            }
        )
    for name, fault in faults.items():
        recover = fault["seconds_to_recover"]
        out[f"{name}_recovers_within_{limit:g}s"] = recover is not None and recover <= limit
    for name in ("retrieval_kill", "redis_stop"):
        if name in faults:
            down = faults[name]["while_down"]
            out[f"{name}_cached_and_plain_kept_succeeding"] = all(
                down[k]["requests"] > 0 and down[k]["errors"] == 0 for k in ("cached", "plain")
            )
    if "gateway_sigterm" in faults:
        gw = faults["gateway_sigterm"]
        out["gateway_sigterm_streams_finish_within_grace"] = (
            gw["streams_in_flight_at_sigterm"] > 0
            and gw["streams_completed_within_grace"] == gw["streams_in_flight_at_sigterm"]
        )
    if faults:
        out["no_crashes_in_faults"] = all(not f["crashed_after"] for f in faults.values())
    for name in ALL_FREEZES:
        if name in faults:
            f = faults[name]
            out[f"{name}_no_deadline_exceeded"] = f["deadline_exceeded"] == 0
            out[f"{name}_only_ok_or_shed_with_retry_info"] = (
                f["other_errors_during"] == 0 and f["shed_without_retry_info"] == 0
            )
            out[f"{name}_shed_p99_le_50ms"] = f["shed_during"] == 0 or (f["shed_p99_s"] or 0) <= 0.050
            first = f["seconds_to_first_success"]
            out[f"{name}_first_success_within_{FREEZE_RECOVERY_S:g}s_of_sigcont"] = (
                first is not None and first <= FREEZE_RECOVERY_S
            )
            if name in FROZEN_HOP:
                answered = f.get("seconds_to_hop_answered")
                out[f"{name}_hop_answers_within_{FREEZE_RECOVERY_S:g}s_of_sigcont"] = (
                    answered is not None and answered <= FREEZE_RECOVERY_S
                )
    if "retrieval_freeze" in faults:
        out["retrieval_freeze_cached_rag_ok_every_second"] = all(
            n > 0 for n in faults["retrieval_freeze"]["ok_per_second_by_kind"]["cached_rag"]
        )
    if "tokenizer_freeze" in faults:
        out["tokenizer_freeze_plain_ok_every_second"] = all(
            n > 0 for n in faults["tokenizer_freeze"]["ok_per_second_by_kind"]["plain"]
        )
    default = result.get("default_budget")
    if default is not None:
        out["default_budget_sheds"] = default["shed"] > 0
        out["default_budget_no_deadline_exceeded"] = default["deadline_exceeded"] == 0
        out["default_budget_lost_zero"] = default["lost"] == 0
        out["default_budget_sheds_carry_retry_info"] = default["shed_without_retry_info"] == 0
        out["default_budget_shed_p99_le_50ms"] = (default["shed_p99_s"] or 0) <= 0.050
    return out


def freeze_figures(sink: Sequence[Outcome], fault: FaultResult, kinds: Sequence[str]) -> dict[str, Any]:
    """Per second of a freeze: successes (in all and per kind), sheds and their p99, deadline errors."""
    during = [o for o in sink if fault.t_down <= o.ended < fault.t_back]
    seconds = max(1, math.floor(fault.t_back - fault.t_down))
    per_second: dict[str, list[int]] = {kind: [0] * seconds for kind in kinds}
    total = [0] * seconds
    for o in during:
        i = int(o.ended - fault.t_down)
        if o.ok and i < seconds:
            total[i] += 1
            if o.kind in per_second:
                per_second[o.kind][i] += 1
    sheds = [o for o in during if o.shed]
    started_during = [o for o in sink if fault.t_down <= o.started < fault.t_back]
    return {
        "freeze_seconds": round(fault.t_back - fault.t_down, 2),
        "ok_per_second": round(sum(total) / max(fault.t_back - fault.t_down, 1e-9), 1),
        "ok_each_second": total,
        "ok_per_second_by_kind": per_second,
        "shed_during": len(sheds),
        "shed_p99_s": round(percentile([o.latency for o in sheds], 0.99), 4) if sheds else None,
        "shed_without_retry_info": sum(not o.retry_info for o in sheds),
        "deadline_exceeded": sum(o.code == "DEADLINE_EXCEEDED" for o in sink if o.ended >= fault.t_down),
        "other_errors_during": sum(o.error for o in started_during),
        "degradations_during": dict(Counter(d for o in during if o.ok for d in o.degradations)),
        "shed_reasons": dict(Counter(o.reason or "none" for o in sheds)),
        "slow_sheds": slow_sheds(sheds),
    }


def slow_sheds(sheds: Sequence[Outcome], over: float = 0.050) -> dict[str, Any]:
    """Where the sheds slower than `over` spent their time: per kind and reason, and the mean of
    the gateway's server-timing per hop (ms; `total` is the gateway's own time before refusing)."""
    slow = [o for o in sheds if o.latency > over]
    hops: Counter[str] = Counter()
    for o in slow:
        hops.update(o.timings)
    return {
        "count": len(slow),
        "by_kind": dict(Counter(o.kind for o in slow)),
        "by_reason": dict(Counter(o.reason or "none" for o in slow)),
        "without_server_timing": sum(not o.timings for o in slow),
        "mean_ms": {hop: round(ms / len(slow), 1) for hop, ms in hops.items()} if slow else {},
    }


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def print_result(result: dict[str, Any]) -> None:
    load = result.get("load")
    if load is not None:
        print_table(
            {k: v for k, v in load.items() if not isinstance(v, dict | list)},
            f"load ({result['model']} model, {load['clients']} clients)",
        )
        print_table(
            {
                kind: f"ok {v['ok']:>5}  shed {v['shed']:>5}  p50 {_s(v['p50_s'])}  shed p99 {_s(v['shed_p99_s'])}  "
                f"pre-admission p50/p99 {v['pre_admission_p50_ms']}/{v['pre_admission_p99_ms']} ms"
                for kind, v in load["by_kind"].items()
            },
            "load by kind",
        )
    rows = []
    for name, f in result.get("faults", {}).items():
        rows.append(
            (
                name,
                f"errors {f['errors_during']:>3}  recover {_s(f['seconds_to_recover'])}  lost {f['lost']}  "
                f"breaker {'opened' if f['breaker_opened'] else 'closed'}  "
                + "  ".join(
                    f"{kind} {v['ok']}/{v['requests']}" for kind, v in f.get("while_down", {}).items() if v["requests"]
                ),
            )
        )
    if rows:
        print_table(rows, "faults (ok/requests per kind while down)")
    freezes = {
        name: f"ok/s {f['ok_per_second']:>6}  min ok in a second {min(f['ok_each_second'], default=0):>3}  "
        f"shed {f['shed_during']:>4}  shed p99 {_s(f['shed_p99_s'])}  deadline errors {f['deadline_exceeded']}  "
        f"first success after SIGCONT {_s(f['seconds_to_first_success'])}"
        + (f"  hop answered {_s(f['seconds_to_hop_answered'])}" if "seconds_to_hop_answered" in f else "")
        for name, f in result.get("faults", {}).items()
        if name in ALL_FREEZES
    }
    if freezes:
        print_table(freezes, "freezes (SIGSTOP, then SIGCONT)")
    default = result.get("default_budget")
    if default is not None:
        print_table({k: v for k, v in default.items() if not isinstance(v, dict | list)}, "load on default settings")
    bad = result.get("bad_input")
    if bad is not None:
        print_table({k: v for k, v in bad.items() if not isinstance(v, dict | list)}, "bad input")
        if bad["unexpected_by_code"]:
            print_table(bad["unexpected_by_code"], "unexpected codes")
    print_table(result["passes"], "targets")


def _s(value: float | None) -> str:
    return "never" if value is None or value != value else f"{value:.3f}s"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="15 s load, shorter faults, 1,000 bad inputs")
    parser.add_argument("--model", default="tiny", help="inference model: tiny (default) or smollm2")
    parser.add_argument(
        "--backend",
        choices=("builtin", "openai"),
        default="builtin",
        help="inference backend: builtin (default) or openai in front of vLLM's CPU build on SmolLM2 "
        "(needs `make vllm`; adds the backend_freeze fault; writes reliability_openai.json)",
    )
    parser.add_argument("--duration", type=float, default=None, help="load seconds (default 60, --quick 15)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--bad-inputs", type=int, default=None, help="bad inputs to send (default 1500, quick 1000)")
    parser.add_argument(
        "--only",
        default="load,default_budget,faults,bad_input",
        help="phases: load, default_budget, faults (or fault names), bad_input",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here instead of bench/results")
    parser.add_argument(
        "--dump",
        type=Path,
        default=None,
        help="write every request of each load phase and fault (and each fault's breaker samples) under DIR",
    )
    parser.add_argument(
        "--gateway-nice",
        type=int,
        default=-10,
        help="LLMESH_NICE of the gateway (default -10: above the model's compute and the load generator)",
    )
    parser.add_argument(
        "--client-nice",
        type=int,
        default=-10,
        help="niceness of this load generator during the load phase (default -10, as the gateway)",
    )
    args = parser.parse_args(argv)
    if args.backend == "openai":
        if not VllmServer.available():
            raise SystemExit("--backend openai needs vLLM's CPU build: run `make vllm` first")
        args.model = "smollm2"  # what vLLM serves; our side of it is its tokenizer
    faults = (*FAULTS, BACKEND_FREEZE) if args.backend == "openai" else FAULTS
    only = {p.strip() for p in args.only.split(",") if p.strip()}
    args.faults = [f for f in faults if "faults" in only or f in only]
    args.only = only
    tiny = args.model == "tiny"
    args.duration = args.duration or (15.0 if args.quick else 60.0)
    args.bad_inputs = args.bad_inputs or (1000 if args.quick else 1500)
    args.calibrate_seconds = 4.0 if args.quick else 6.0
    args.new_tokens = 32 if tiny else 16
    args.deadline = 15.0 if tiny else 60.0
    args.fault_clients = 16
    args.fault_seconds = 12.0 if args.quick else 20.0
    args.fault_warmup = 2.0 if args.quick else 3.0
    args.fault_deadline = 10.0 if tiny else 60.0
    # A mutation can be a valid request for 512 new tokens at temperature 2: it must get its
    # answer, not a client-side DEADLINE_EXCEEDED, so bad inputs get a generous deadline.
    args.bad_input_deadline = 60.0
    args.down_seconds = 2.0
    args.stall_seconds = 4.0
    args.freeze_seconds = 4.0 if args.quick else 6.0
    args.long_streams = 8
    bench = Reliability(args)
    try:
        result = asyncio.run(bench.main())
    finally:
        bench.cleanup()
    result = _finite(result)
    print_result(result)
    complete = {"load", "default_budget", "bad_input"} <= args.only and len(args.faults) == len(faults)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    elif complete:
        name = "reliability" if args.backend == "builtin" else "reliability_openai"
        print(f"wrote {write_result(name, result)}")
    else:
        print("partial run: bench/results/reliability.json left as it was (use --out to keep this one)")


if __name__ == "__main__":
    main()

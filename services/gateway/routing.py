"""A model's replicas over gRPC: one channel, health check and load watch per replica,
the replica set re-resolved from DNS, and Generate routed with one retry before its first token.
The decisions are `services/gateway/replicas.py`'s; this module only feeds it and acts on them.

Targets: `host:port` (one replica, as before), `host:port|host:port|...` (a static set), or
`dns:///name:port` (a headless Service: every address the name resolves to is a replica,
re-resolved every `dns_refresh_seconds`, so the set follows scale-up and scale-down)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh import tasks
from llmesh.channels import PeerAccess, peer_channel
from llmesh.errors import LlmeshError, Unavailable, from_rpc_error
from llmesh.prefix_hash import block_hashes
from llmesh.v1 import inference_pb2, inference_pb2_grpc
from services.gateway import metrics
from services.gateway.admission.load import LoadBook
from services.gateway.breaker import CircuitBreaker
from services.gateway.deadline import CallerDeadline, Deadline
from services.gateway.hop_errors import BREAKER_FAILURE_CODES, PeerCallError
from services.gateway.load_report import ReplicaReport
from services.gateway.multiplex import GenerationMux
from services.gateway.replicas import Flight, Replica, ReplicaSet, RoutingConfig

log = logging.getLogger("llmesh.gateway.routing")

Resolver = Callable[[str, int], Awaitable[list[str]]]
#: Reconnect quickly to a replica that restarts (gRPC's default backoff grows to 2 minutes).
REPLICA_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000))
#: Load reports at least this often: a frozen replica falls silent within one interval.
LOAD_INTERVAL_S = 0.25
LOAD_RETRY_S = 0.5
LOAD_UNIMPLEMENTED_RETRY_S = 30.0
#: Prefix blocks hashed per prompt for affinity (16-token blocks: 4k tokens).
AFFINITY_BLOCKS = 256
#: Codes worth another replica before the first token: its failures, and its refusals (it is full).
RETRY_CODES = BREAKER_FAILURE_CODES | {grpc.StatusCode.RESOURCE_EXHAUSTED}


def replica_targets(target: str) -> list[str]:
    """The static replicas of a target (`a:1|b:2`); a dns:/// target is resolved later."""
    return [t.strip() for t in target.split("|") if t.strip()]


def dns_name(target: str) -> tuple[str, int] | None:
    """(host, port) of a `dns:///host:port` (or `dns://authority/host:port`) target, else None."""
    if not target.startswith("dns:"):
        return None
    rest = target[len("dns:") :]
    if rest.startswith("//"):
        rest = rest[2:].partition("/")[2]
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{target!r}: expected dns:///host:port")
    return host, int(port)


def routed(target: str) -> bool:
    """Whether a model's target needs the replica router (several replicas, or DNS)."""
    return len(replica_targets(target)) > 1 or dns_name(target) is not None


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = []
    for family, _, _, _, address in infos:
        ip = address[0]
        found.append(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(set(found))


class _Attempt:
    """One Generate call on one replica; the replica set may cut it short (`cancel`)."""

    __slots__ = ("call", "reason", "retryable")

    def __init__(self) -> None:
        self.call: Any = None
        self.reason: str | None = None
        self.retryable = False

    def cancel(self, retryable: bool, reason: str = "ejected") -> None:
        if self.reason is None:
            self.reason, self.retryable = reason, retryable
            if self.call is not None:
                self.call.cancel()


class _Retry(Exception):
    """An attempt that ended before its first token in a way another replica may fix."""

    def __init__(self, error: LlmeshError, failed: bool, free: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.failed = failed
        # Cut by its replica's ejection: the work moves (the ejected replica will not do it), so
        # it spends no retry budget.
        self.free = free


class ReplicaRouter:
    """The replicas of one model: channels, health checks, load watches, DNS, and Generate."""

    def __init__(
        self,
        model: str,
        target: str,
        max_message_bytes: int,
        access: PeerAccess | None = None,
        config: RoutingConfig | None = None,
        loads: LoadBook | None = None,
        resolver: Resolver = system_resolver,
        multiplex: bool = True,
    ) -> None:
        self.model = model
        self.label = model or "default"
        self.target = target
        self.config = config or RoutingConfig()
        self.loads = loads
        self.resolver = resolver
        self.max_message_bytes = max_message_bytes
        self.access = access or PeerAccess()
        self.dns = dns_name(target)
        self.set = ReplicaSet(model, self.config, on_eject=self._ejected, on_return=self._returned)
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.stubs: dict[str, inference_pb2_grpc.InferenceStub] = {}
        self.multiplex = multiplex
        self.generators: dict[str, GenerationMux] = {}  # each replica's Generate calls (one stream)
        self.health_stubs: dict[str, health_pb2_grpc.HealthStub] = {}
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._loops: list[asyncio.Task[None]] = []
        self._closing: list[grpc.aio.Channel] = []
        self.connected = asyncio.Event()  # a first load report came
        self._changed: asyncio.Condition | None = None  # notified on reports, ejections, returns
        self.started = False
        if self.dns is None:
            self._apply(replica_targets(target))

    # --- membership -----------------------------------------------------------------------------
    def _apply(self, addresses: Sequence[str]) -> None:
        added, removed = self.set.set_addresses(addresses)
        for r in removed:
            log.info("model %s: replica %s left", self.label, r.address)
            for task in self._tasks.pop(r.address, []):
                task.cancel()
            self.stubs.pop(r.address, None)
            self.health_stubs.pop(r.address, None)
            generator = self.generators.pop(r.address, None)
            if generator is not None:
                generator.retire()
            channel = self.channels.pop(r.address, None)
            if channel is not None:
                self._closing.append(channel)
            self._unbook(r)
            with contextlib.suppress(KeyError):
                metrics.REPLICA_EJECTED.remove(self.label, r.address)
        for r in added:
            options: list[tuple[str, Any]] = list(REPLICA_CHANNEL_OPTIONS)
            if self.dns is not None and self.access.credentials is not None:
                options.append(("grpc.ssl_target_name_override", self.dns[0]))
            channel = peer_channel(r.address, self.max_message_bytes, self.access, options)
            self.channels[r.address] = channel
            self.stubs[r.address] = inference_pb2_grpc.InferenceStub(channel)
            self.generators[r.address] = GenerationMux(self.stubs[r.address], self.multiplex)
            self.health_stubs[r.address] = health_pb2_grpc.HealthStub(channel)
            metrics.REPLICA_EJECTED.labels(self.label, r.address).set(0)
            if self.started:
                self._start_replica(r)
        if added or removed:
            metrics.REPLICAS.labels(self.label).set(len(self.set.replicas))
            log.info("model %s: replicas %s", self.label, ", ".join(self.set.replicas) or "none")

    async def refresh(self) -> None:
        """Resolves a dns:/// target again; the replicas follow what it names (kept when the
        lookup fails or names nothing: a DNS hiccup must not empty the set)."""
        if self.dns is None:
            return
        try:
            addresses = await self.resolver(*self.dns)
        except OSError as exc:
            log.warning("model %s: resolving %s failed: %s", self.label, self.target, exc)
            return
        if addresses:
            self._apply(addresses)

    # --- life -----------------------------------------------------------------------------------
    async def start(self) -> None:
        self.started = True
        loop = asyncio.get_running_loop()
        if self.dns is not None:
            await self.refresh()
            self._loops.append(loop.create_task(self._dns_loop()))
        for r in self.set.replicas.values():
            self._start_replica(r)
        self._loops.append(loop.create_task(self._tick_loop()))

    def _start_replica(self, r: Replica) -> None:
        loop = asyncio.get_running_loop()
        self._tasks[r.address] = [loop.create_task(self._health_loop(r)), loop.create_task(self._watch_loop(r))]

    async def close(self) -> None:
        await tasks.stop_all([*self._loops, *(t for ts in self._tasks.values() for t in ts)])
        for generator in self.generators.values():
            await generator.close()
        for channel in [*self.channels.values(), *self._closing]:
            await channel.close()

    async def _dns_loop(self) -> None:
        while True:
            # Knowing no replica yet (the Service had no ready pod): ask again within a second.
            every = self.config.dns_refresh_seconds if self.set.replicas else min(1.0, self.config.dns_refresh_seconds)
            await asyncio.sleep(every)
            await self.refresh()
            self._close_departed()

    def _close_departed(self) -> None:
        closing, self._closing = self._closing, []
        for channel in closing:
            asyncio.get_running_loop().create_task(channel.close(grace=30.0))

    async def _tick_loop(self) -> None:
        every = min(0.1, self.config.stall_seconds / 4)
        while True:
            await asyncio.sleep(every)
            self.set.tick(periodic=True)

    async def _health_loop(self, r: Replica) -> None:
        request = health_pb2.HealthCheckRequest(service="")
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            stub = self.health_stubs.get(r.address)
            if stub is None:
                return
            verdict: bool | None
            try:
                reply = await stub.Check(request, timeout=self.config.health_timeout_seconds)
                verdict = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.set.health(r, None)
                    return  # no health service: ejection from calls and load only
                verdict = False
            self.set.health(r, verdict)
            await asyncio.sleep(max(0.0, self.config.health_interval_seconds - (loop.time() - started)))

    async def _watch_loop(self, r: Replica) -> None:
        request = inference_pb2.WatchLoadRequest(max_interval_seconds=LOAD_INTERVAL_S)
        while True:
            retry = LOAD_RETRY_S
            stub = self.stubs.get(r.address)
            if stub is None:
                return
            call = stub.WatchLoad(request)
            try:
                async for report in call:
                    self._report(r, report)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    retry = LOAD_UNIMPLEMENTED_RETRY_S
            finally:
                call.cancel()
                self._unreport(r)
            await asyncio.sleep(retry)

    def _report(self, r: Replica, report: inference_pb2.LoadReport) -> None:
        if not report.reported:
            self._unreport(r)
            return
        load = ReplicaReport.from_message(report, self.set.clock(), prefix_hashes=True)
        if r.load is not None and r.load.replica != load.replica:
            self._unbook(r)  # restarted: its old self reports no more
        self.set.reported(r, load)
        if self.loads is not None and not r.ejected:
            self.loads.model(self.model).update(load)  # admission counts the healthy replicas' room
        self.connected.set()
        self._notify()

    def _unbook(self, r: Replica) -> None:
        """Admission stops counting the replica's room (it left, restarted, stopped reporting or
        was ejected): the book holds only what this router says is there."""
        if self.loads is not None and r.load is not None and r.load.replica:
            self.loads.model(self.model).drop(r.load.replica)

    def _unreport(self, r: Replica) -> None:
        self._unbook(r)
        self.set.unreported(r)

    def _ejected(self, r: Replica, reason: str) -> None:
        log.warning("model %s: replica %s ejected (%s, #%d)", self.label, r.address, reason, r.ejections + 1)
        metrics.REPLICA_EJECTED.labels(self.label, r.address).set(1)
        metrics.REPLICA_EJECTIONS.labels(self.label, r.address, reason).inc()
        self._unbook(r)
        self._notify()

    def _returned(self, r: Replica) -> None:
        log.info("model %s: replica %s is back", self.label, r.address)
        metrics.REPLICA_EJECTED.labels(self.label, r.address).set(0)
        self._notify()

    def _notify(self) -> None:
        changed = self._changed
        if changed is None:
            return

        async def notify() -> None:
            async with changed:
                changed.notify_all()

        asyncio.get_running_loop().create_task(notify())

    async def wait_for(self, predicate: Callable[[ReplicaSet], bool], timeout: float) -> None:
        """Waits until `predicate(set)` holds, looking again at each report, ejection and return
        (tests, benchmarks); TimeoutError after `timeout`."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        changed = self._changed
        async with asyncio.timeout(timeout), changed:
            await changed.wait_for(lambda: predicate(self.set))

    # --- calls ----------------------------------------------------------------------------------
    def info_stub(self) -> inference_pb2_grpc.InferenceStub:
        """A replica to ask cheap questions (model info): a healthy one, else any."""
        for r in self.set.healthy() or list(self.set.replicas.values()):
            stub = self.stubs.get(r.address)
            if stub is not None:
                return stub
        raise PeerCallError(Unavailable(f"inference/{self.label}: no replica is known"))

    def health_stub(self) -> health_pb2_grpc.HealthStub:
        for r in self.set.healthy() or list(self.set.replicas.values()):
            stub = self.health_stubs.get(r.address)
            if stub is not None:
                return stub
        raise PeerCallError(Unavailable(f"inference/{self.label}: no replica is known"))

    async def generate(
        self,
        request: inference_pb2.InferenceRequest,
        deadline: Deadline,
        breaker: CircuitBreaker,
        patient: bool = False,
    ) -> AsyncIterator[inference_pb2.InferenceResponse]:
        """Generate on the replica the set picks; a failure, refusal or timeout before the first
        token is tried once more on another replica (within the deadline and the retry budget);
        after the first token, never. `breaker`: the model's own, told how the model as a whole
        answered (the replicas' failures are the set's business); a `patient` call's wait for its
        first token is not judged (see upstream.call_stream)."""
        deadline.check(f"inference/{self.label}")
        permit = breaker.acquire()
        loop = asyncio.get_running_loop()
        started = loop.time()
        ids = list(request.token_ids.ids) if request.HasField("token_ids") else []
        hashes = block_hashes(ids, self.set.block_tokens(), AFFINITY_BLOCKS) if ids else []
        self.set.budget.earn()
        tried: list[Replica] = []
        ttft: float | None = None
        choice = self.set.pick(hashes)
        try:
            while True:
                if choice is None:
                    raise PeerCallError(Unavailable(f"inference/{self.label}: no replica is known"))
                if hashes:
                    metrics.AFFINITY.labels(self.label, choice.affinity).inc()
                attempt = _Attempt()
                flight = self.set.start(choice, request.sampling.max_new_tokens or 1, hashes, attempt.cancel)
                metrics.REPLICA_REQUESTS.labels(self.label, choice.replica.address).inc()
                verdict: bool | None = None
                try:
                    async for message in self._attempt(choice.replica, request, deadline, attempt, flight):
                        if ttft is None:
                            ttft = 0.0 if patient else loop.time() - started
                            if permit.trial:
                                permit.success(ttft)
                        yield message
                    verdict = False
                    permit.success(ttft if ttft is not None else 0.0 if patient else loop.time() - started)
                    return
                except _Retry as retry:
                    verdict = retry.failed
                    tried.append(choice.replica)
                    # Once, on a healthy replica not tried yet, within the deadline and the budget.
                    again = None if len(tried) > 1 or deadline.remaining() <= 0 else self.set.pick(hashes, tried)
                    if again is None or not (retry.free or self.set.budget.spend()):
                        # Tried twice, or no one else to try: the model failed this request.
                        if retry.failed or retry.free:
                            permit.failure()
                        raise retry.error from None
                    metrics.REPLICA_RETRIES.labels(self.label, attempt.reason or "failed").inc()
                    log.info(
                        "model %s: retrying on %s, %s failed before its first token: %s",
                        self.label,
                        again.replica.address,
                        choice.replica.address,
                        retry.error.message,
                    )
                    choice = again
                except PeerCallError as exc:
                    # After its first token (or not worth a retry): the replica's failure, judged
                    # by its outlier detection; the model's breaker hears only what no other
                    # replica could have saved.
                    verdict = exc.code in BREAKER_FAILURE_CODES
                    raise
                finally:
                    self.set.finish(flight, verdict)
        finally:
            permit.release()

    async def _attempt(
        self,
        r: Replica,
        request: inference_pb2.InferenceRequest,
        deadline: Deadline,
        attempt: _Attempt,
        flight: Flight,
    ) -> AsyncIterator[inference_pb2.InferenceResponse]:
        name = f"inference/{self.label}@{r.address}"
        remaining = deadline.check(name)
        generator = self.generators.get(r.address)
        if generator is None:
            raise _Retry(PeerCallError(Unavailable(f"{name}: the replica left")), False)
        call = generator.generate(request, remaining)
        attempt.call = call
        loop = asyncio.get_running_loop()
        timer = None
        if self.config.first_token_timeout_seconds > 0 and remaining > self.config.first_token_timeout_seconds:
            timer = loop.call_later(
                self.config.first_token_timeout_seconds, attempt.cancel, True, "first_token_timeout"
            )
        try:
            async for message in call:
                if timer is not None:
                    timer.cancel()
                    timer = None
                self.set.progress(flight, len(message.token_ids) or 1)
                yield message
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if attempt.reason is None or (task is not None and task.cancelling()):
                raise
            raise self._cut(name, attempt, flight) from None
        except grpc.aio.AioRpcError as err:
            if attempt.reason is not None:
                raise self._cut(name, attempt, flight) from None
            if (
                err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
                and deadline.remaining() <= 0.01
            ):
                raise CallerDeadline(f"{name}: the request's deadline ran out") from err
            error = PeerCallError(from_rpc_error(f"inference/{self.label}", err))
            if not flight.first_token and err.code() in RETRY_CODES:
                raise _Retry(error, err.code() in BREAKER_FAILURE_CODES) from err
            raise error from err
        finally:
            if timer is not None:
                timer.cancel()
            call.cancel()

    def _cut(self, name: str, attempt: _Attempt, flight: Flight) -> Exception:
        """The error for an attempt the set cut short (ejected, or no first token in time)."""
        error = PeerCallError(Unavailable(f"{name}: {attempt.reason}"))
        if not flight.first_token and attempt.retryable:
            timed_out = attempt.reason == "first_token_timeout"
            return _Retry(error, failed=timed_out, free=not timed_out)
        return PeerCallError(error)

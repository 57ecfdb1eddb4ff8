"""gRPC side of the gateway: the public service, request deadlines, streaming."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc
from opentelemetry import trace
from starlette.routing import Route

from llmesh import redis_server, tasks
from llmesh.channels import peer_access, remaining_seconds
from llmesh.chat_template import ChatTemplate, load_template
from llmesh.models import resolve
from llmesh.settings import GatewayServiceSettings, SettingsError
from llmesh.v1 import batches_pb2, batches_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from services.gateway import metrics
from services.gateway.admin import AdminKeys
from services.gateway.admission import AdmissionConfig, LoadBook, RedisWeightWindow, WeightWindow, connect_redis
from services.gateway.auth import Caller, KeyRing
from services.gateway.batches.api import BatchApi
from services.gateway.batches.grpc_api import BatchesServicer
from services.gateway.batches.lines import LineEndpoints
from services.gateway.batches.runner import BatchRunner, engine_room
from services.gateway.batches.service import BatchLimits, BatchService
from services.gateway.batches.store import BatchStore
from services.gateway.breaker import BreakerConfig, State, TransitionListener
from services.gateway.core import Delta, Final, Gateway, GatewayConfig, server_timing
from services.gateway.deadline import Deadline
from services.gateway.intake import InvalidCallBudget, KeyGate, authorization_in, request_limits
from services.gateway.limits import KeyLimiter
from services.gateway.messages_api import MessagesApi
from services.gateway.openai_http import ErrorShape, OpenAiApi, announce, http_api
from services.gateway.peers import HopBudgets, Peers, breaker_labels
from services.gateway.replicas import RoutingConfig
from services.gateway.response_store import MemoryResponses, RedisResponses, ResponseStore
from services.gateway.responses_api import ResponsesApi
from services.gateway.usage import TenantLabels, UsageMeter

log = logging.getLogger("llmesh.gateway")


def breaker_listener(peer: str) -> TransitionListener:
    """Logs, counts and marks on the active span every breaker state change."""
    labels = (peer, *breaker_labels(peer))
    metrics.BREAKER_STATE.labels(*labels).set(0)

    def on_transition(old: State, new: State, reason: str) -> None:
        log.warning(
            "circuit breaker %s: %s -> %s (%s)",
            peer,
            old.value,
            new.value,
            reason,
            extra={
                "fields": {
                    "event": "breaker_transition",
                    "peer": peer,
                    "from": old.value,
                    "to": new.value,
                    "reason": reason,
                }
            },
        )
        metrics.BREAKER_STATE.labels(*labels).set(new.level)
        metrics.BREAKER_TRANSITIONS.labels(*labels, old.value, new.value).inc()
        trace.get_current_span().add_event(
            "llmesh.breaker.transition",
            {
                "llmesh.breaker.peer": peer,
                "llmesh.breaker.from": old.value,
                "llmesh.breaker.to": new.value,
                "llmesh.breaker.reason": reason,
            },
        )

    return on_transition


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self, gateway: Gateway, default_deadline: float, api_keys: KeyRing, admin_keys: AdminKeys | None = None
    ) -> None:
        self.gateway = gateway
        self.default_deadline = default_deadline
        self.api_keys = api_keys
        self.admin_keys = admin_keys or AdminKeys(frozenset())

    def _caller(self, context: grpc.aio.ServicerContext, tenant: str) -> Caller:
        """The caller's key, authorized for the tenant the request names; none named: the key's only
        tenant, else "default" (as on HTTP)."""
        return self.api_keys.caller(authorization_in(context.invocation_metadata() or ()), tenant)

    def _as_caller(self, context: grpc.aio.ServicerContext, request: Any) -> tuple[Any, Caller]:
        """The request acting for the caller's tenant: one that names none runs, is scoped and is
        billed as its key's tenant, never as "default" beside it."""
        caller = self._caller(context, request.tenant)
        if request.tenant != caller.tenant:
            scoped = type(request)()
            scoped.CopyFrom(request)
            scoped.tenant = caller.tenant
            request = scoped
        return request, caller

    def _begin(self, context: grpc.aio.ServicerContext, request: Any) -> tuple[Any, Deadline, Caller]:
        """Authorizes the caller for the request's tenant, then fixes the request's deadline."""
        request, caller = self._as_caller(context, request)
        return request, Deadline.after(remaining_seconds(context, self.default_deadline)), caller

    def _generation(self, request, context):  # type: ignore[no-untyped-def]
        return self.gateway.generate(*self._begin(context, request))

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        final: Final | None = None
        async for event in self._generation(request, context):
            if isinstance(event, Final):
                final = event
        assert final is not None
        context.set_trailing_metadata((("server-timing", server_timing(final.timings)),))
        return final.response

    async def GenerateStream(self, request, context):  # type: ignore[no-untyped-def]
        async for event in self._generation(request, context):
            if isinstance(event, Delta):
                if event.text or event.logprobs:
                    yield gateway_pb2.GenerateStreamResponse(
                        delta=event.text, index=event.index, logprobs=event.logprobs
                    )
            else:
                context.set_trailing_metadata((("server-timing", server_timing(event.timings)),))
                yield gateway_pb2.GenerateStreamResponse(final=event.response)

    async def Embed(self, request, context):  # type: ignore[no-untyped-def]
        return await self.gateway.embed(*self._begin(context, request))

    async def Ingest(self, request, context):  # type: ignore[no-untyped-def]
        return await self.gateway.ingest(*self._begin(context, request))

    async def Search(self, request, context):  # type: ignore[no-untyped-def]
        return await self.gateway.search(*self._begin(context, request))

    async def PurgeCache(self, request, context):  # type: ignore[no-untyped-def]
        authorization = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        self.admin_keys.authorize(authorization if isinstance(authorization, str) else None)
        deadline = Deadline.after(remaining_seconds(context, self.default_deadline))
        return await self.gateway.purge_cache(request, deadline)

    async def ListModels(self, request, context):  # type: ignore[no-untyped-def]
        authorization = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        self.api_keys.authenticate(authorization if isinstance(authorization, str) else None)
        deadline = Deadline.after(remaining_seconds(context, self.default_deadline))
        return await self.gateway.list_models(deadline)


def local_templates(
    models_path: Path, default_model: str, routes: list[str], tool_format: str = ""
) -> dict[str, ChatTemplate]:
    """The chat templates of the routes' models found in the models folder on this host (a
    route "" is the tokenizer's default model); what the gateway renders with while the tokenizer
    is away and before it has learned them from it. None there (the usual deployment) is fine."""
    found: dict[str, ChatTemplate] = {}
    for route in routes:
        try:
            found[route] = load_template(resolve(models_path, route or default_model), tool_format)
        except (OSError, ValueError):
            continue
    return found


class GatewayApp:
    service_names = (
        gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,
        batches_pb2.DESCRIPTOR.services_by_name["Batches"].full_name,
    )

    def __init__(self, settings: GatewayServiceSettings) -> None:
        s = settings
        auth = s.auth
        try:  # first: a bad keys file stops the gateway before it opens anything
            self.api_keys = KeyRing(auth.api_keys, auth.api_keys_file, auth.api_keys_reload_seconds)
        except ValueError as exc:
            raise SettingsError(f"invalid settings: LLMESH_API_KEYS_FILE: {exc}") from None
        targets = {
            "tokenizer": s.tokenizer_peer.target,
            "inference": s.peers.inference_target,
            "cache": s.peers.cache_target,
            "retrieval": s.peers.retrieval_target,
        }
        # One inference peer per model (name -> target); without LLMESH_MODELS the one at
        # LLMESH_INFERENCE_TARGET, unnamed.
        models, default_model = s.peers.model_routes()
        # Each model's inference reports its own load; admission decides on it. A model
        # with several replicas is routed over them, each replica's load feeding the book.
        self.loads = LoadBook()
        self.peers = Peers(
            targets,
            s.runtime.max_message_bytes,
            BreakerConfig.from_settings(s.breaker),
            breaker_listener,
            peer_access(s.runtime),
            HopBudgets.from_settings(s.hops),
            models,
            probe_seconds=s.breaker.probe_seconds,
            routing=RoutingConfig.from_settings(s.routing),
            loads=self.loads,
            multiplex=s.routing.multiplex,
        )
        admission = AdmissionConfig.from_settings(s.admission)
        # The single-replica models' load watches (each its upstream's, started and stopped with it).
        self.load_watchers = [u.watcher for u in self.peers.models.values() if u.watcher is not None]
        # The admission window and the per-key limits are cluster-wide through one Redis, when set.
        shared_url = s.admission.redis_url
        self.window: WeightWindow | RedisWeightWindow = (
            RedisWeightWindow(
                admission,
                connect_redis(redis_server.resolve_url(shared_url, s)),
                replicas=s.admission.replicas,
            )
            if shared_url
            else WeightWindow(admission)
        )
        self.limiter = KeyLimiter(
            connect_redis(redis_server.resolve_url(shared_url, s)) if shared_url else None,
            replicas=s.admission.replicas,
            sync_seconds=auth.key_limit_sync_seconds,
        )
        usage = UsageMeter(self.limiter, TenantLabels(s.usage.max_tenants, self.api_keys.tenants), s.usage.metrics)
        self._watch: asyncio.Task[None] | None = None
        config = GatewayConfig(
            default_collection=s.collections.default_collection,
            default_top_k=s.requests.default_top_k,
            min_context_score=s.requests.min_context_score,
            max_prompt_bytes=s.requests.max_prompt_bytes,
            max_prompt_tokens=s.generation.max_prompt_tokens,
            max_new_tokens=s.generation.max_new_tokens,
            default_max_new_tokens=s.generation.default_max_new_tokens,
            log_prompts=s.runtime.log_prompts,
            version_ttl=s.requests.collection_version_ttl_seconds,
            cache_store_budget=s.hops.cache_store_seconds,
        )
        try:
            self.gateway = Gateway(
                self.peers,
                config,
                self.window,
                list(models),
                default_model,
                s.requests.model_aliases,
                usage,
                loads=self.loads,
                local_templates=local_templates(
                    s.runtime.models_path, s.tokenizer_model.model, list(models), s.tokenizer_model.tool_call_format
                ),
                ingest_budget_bytes=s.request_limits.ingest_max_bytes_in_flight,
            )
        except ValueError as exc:
            raise SettingsError(f"invalid settings: LLMESH_MODEL_ALIASES: {exc}") from None
        admin_keys = AdminKeys.parse(auth.admin_keys)
        self.servicer = GatewayServicer(self.gateway, s.requests.default_deadline_seconds, self.api_keys, admin_keys)
        # Read by the runtime's interceptor: each method's limits on a request's bytes, and the key
        # check on a call's metadata, both before the request is parsed.
        self.request_limits = request_limits(s.request_limits)
        self.admit_call = KeyGate(self.api_keys, admin_keys, InvalidCallBudget(auth.invalid_calls_per_minute))
        self.call_refused = self.admit_call.refused
        # The Batch API: jobs in the state Redis (a longer timeout than the window's: files are
        # large), their lines run here and on every other replica (services/gateway/batches/).
        # Its own setting: a durable store does not turn on the shared admission window.
        state_url = redis_server.state_url(s)
        self.batch_redis = (
            connect_redis(redis_server.resolve_url(state_url, s), socket_timeout=10.0) if state_url else None
        )
        store = BatchStore(self.batch_redis) if self.batch_redis is not None else None
        self.batch_lines = LineEndpoints(self.gateway, s.requests.default_deadline_seconds)
        limits = BatchLimits(s.batch.max_file_bytes, s.batch.max_lines, s.batch.max_in_flight)
        self.batches = BatchService(store, limits, self.batch_lines)
        self.batch_runner = (
            BatchRunner(
                store,
                self.batch_lines,
                self.api_keys,
                s.batch.concurrency,
                s.batch.lease_seconds,
                room=lambda: engine_room(self.loads, list(models)),
            )
            if store is not None
            else None
        )
        if self.batch_runner is not None:
            self.batches.on_created.append(self.batch_runner.wake)
        self.batches_servicer = BatchesServicer(self.batches, self.api_keys)
        # The OpenAI-compatible HTTP API: another adapter over the same Gateway.
        # Stored Responses-API answers: in the replicas' state Redis where there is one.
        ttl = s.http.responses_ttl_seconds
        self.responses: ResponseStore = (
            RedisResponses(connect_redis(redis_server.resolve_url(state_url, s)), ttl)
            if state_url
            else MemoryResponses(ttl)
        )
        self.http = http_api(
            self.gateway,
            self.api_keys,
            s,
            self.admit_call,
            BatchApi(self.batches, self.api_keys).routes(),
            self._more_apis,
        )

    def _more_apis(self, api: OpenAiApi) -> tuple[list[Route], dict[str, ErrorShape]]:
        """The Responses and Messages APIs beside OpenAI's chat, over the same gateway."""
        responses, messages = ResponsesApi(api, self.responses), MessagesApi(api)
        return [*responses.routes(), *messages.routes()], messages.error_shapes()

    def register(self, server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, server)
        batches_pb2_grpc.add_BatchesServicer_to_server(self.batches_servicer, server)

    async def start(self) -> None:
        if self.api_keys.path is not None:
            self._watch = asyncio.get_running_loop().create_task(self.api_keys.watch())
        self.limiter.start()
        await self.peers.start()
        announce(await self.http.start() if self.http is not None else 0)
        if self.batch_runner is not None:
            self.batch_runner.start()

    async def drain(self, grace: float) -> None:
        if self.batch_runner is not None:
            await self.batch_runner.stop(release=True)  # another replica carries the lines on at once
        if self.http is not None:
            await self.http.stop()

    def health_details(self) -> dict[str, bool]:
        """`llmesh.v1.Gateway/redis` when replicas share an admission window: NOT_SERVING while Redis
        is down and this replica admits on its local fallback budget (it keeps serving)."""
        if isinstance(self.window, RedisWeightWindow):
            return {"redis": self.window.redis_ok and self.limiter.redis_ok}
        return {}

    async def stop(self) -> None:
        await self.gateway.settle()
        await tasks.stop(self._watch)
        await self.limiter.close()
        if isinstance(self.responses, RedisResponses):
            await self.responses.redis.aclose()
        if self.limiter.redis is not None:
            await self.limiter.redis.aclose()
        await self.peers.close()
        if self.batch_runner is not None:
            await self.batch_runner.stop(release=True)
        if self.batch_redis is not None:
            await self.batch_redis.aclose()
        if isinstance(self.window, RedisWeightWindow):
            await self.window.settle()
            await self.window.redis.aclose()

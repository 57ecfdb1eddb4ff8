"""What a request's path (pipeline.RequestPath) needs from the gateway that runs it, as a
Protocol the gateway (core.Gateway) satisfies, and the route of one served model. The path gets
its collaborators through this, never the gateway's own state, so it does not import core."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from llmesh.chat_template import ChatTemplate
from llmesh.v1 import cache_pb2, gateway_pb2
from services.gateway.admission import AdmissionController, RedisWeightWindow, WeightWindow
from services.gateway.deadline import Deadline
from services.gateway.peers import Peers
from services.gateway.plan import GatewayConfig, InputTokenPredictor, Plan


@dataclass
class ModelRoute:
    """One model the gateway routes to: its name (requests' `model`), its inference peer in
    `Peers` (own channel and circuit breaker: `inference_peer(name)`), the tokenizer it asks for,
    and its model key as last learned from its inference. Admission is per model through the
    model key (`WeightWindow.capacity(key)`: its own in-flight limit, learned from its own
    tokens). The name "" is the one model of a deployment that lists none (LLMESH_MODELS empty):
    its public name is the id its inference reports, and the tokenizer's default serves it."""

    name: str
    # (when learned, model key)
    learned: tuple[float, str] | None = None
    #: What its inference last reported serving in ("bfloat16+int4"; "" where the backend does not say).
    dtype: str = ""

    @property
    def tokenizer(self) -> str:
        return self.name

    def expire(self) -> None:
        """The next `model_key` asks inference again (the learned key serves if it fails)."""
        if self.learned is not None:
            self.learned = (-math.inf, self.learned[1])

    def public_name(self) -> str | None:
        """The name clients see and route by; for the unnamed model, None until learned."""
        if self.name:
            return self.name
        return self.learned[1].rpartition("@")[0] if self.learned is not None else None


@dataclass(frozen=True)
class ModelChoice:
    """A request's `model` resolved once (`Gateway.resolve`): the route of the model it names, or
    an alias's routes in the order they are tried. An adapter that checks the model before the
    request goes (the HTTP API) hands this on, and the path does not resolve it again."""

    asked: str
    routes: tuple[ModelRoute, ...]
    alias: bool = False


class RequestGateway(Protocol):
    """The gateway's members a request's path uses: its wiring (config, window, admission, peers
    (each downstream's `Upstream`, the one owner of its health; retrieval's also of the collection
    versions), token predictors, chat templates) and
    the few services it offers each request."""

    config: GatewayConfig
    window: WeightWindow | RedisWeightWindow
    admission: AdmissionController
    peers: Peers
    predictor: InputTokenPredictor
    templates: dict[str, ChatTemplate]
    local_templates: dict[str, ChatTemplate]

    async def route(self, model: str, deadline: Deadline) -> ModelRoute: ...

    async def model_key(self, deadline: Deadline, model: str = "") -> str: ...

    def predictor_for(self, model: str) -> InputTokenPredictor: ...

    def cache_scope(self, plan: Plan, model: str, collection: str, version: int) -> cache_pb2.CacheScope: ...

    def store_later(self, plan: Plan, scope: cache_pb2.CacheScope, response: gateway_pb2.GenerateResponse) -> None: ...

    def learn_template(self, tokenizer: str) -> None: ...

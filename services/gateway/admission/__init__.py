"""Admission by request weight over a sliding time window (gateway domain logic, no gRPC here).

Weight
    ``request_weight(input_tokens, max_new_tokens) = max(1, input_tokens) * max(1, max_new_tokens)``:
    prompt length times the generation budget, a simple proxy for the KV-cache x decode-steps a
    request may hold. Each factor counts at least 1 so every admitted request costs something.
    Cache hits cost nothing: the gateway does not call admission for them.

Window
    Every admitted weight is kept for ``window_seconds`` (an entry admitted at ``t`` counts while
    ``now < t + window_seconds``). A request is admitted when, after adding it,

    * global occupancy <= ``budget * lane_share(lane)`` (the lane ceiling: ``interactive`` may use the
      whole budget, ``batch`` is admitted only while the total stays under its fraction, so
      interactive traffic always keeps ``1 - batch_share`` of the budget as headroom), and
    * the tenant's occupancy <= its budget: the explicit override from ``tenant_budgets`` or
      ``tenant_share * budget`` (never more than ``budget``), so one tenant's burst cannot starve others.

    A refusal raises ``ResourceExhausted`` at once with ``retry_after`` = the exact time until enough
    old entries leave the window for the request to fit (if nothing else is admitted meanwhile).
    A request that can never fit raises ``RequestTooHeavy`` (no retry pushback); ``fits_ever`` tells
    beforehand.

Degrade
    ``plan`` caps ``max_new_tokens`` down (not below ``min_new_tokens``) to the largest value that fits
    now, before refusing.

Reservation and refund
    ``plan`` reserves the request's whole weight (input x max_new_tokens) and returns it as a
    ``Ticket``. As tokens come back the ticket reports progress; ``Ticket.finish`` (on every exit
    path: finished early, failed, refused downstream, breaker open, cancelled) refunds from the
    window what was not used, so a request that stops early, or never ran, pays only for what it
    generated and a retry does not pay twice.

Weight in flight
    Besides the rate, the weight admitted and not yet generated is bounded, per model, by a limit
    learned from what inference is measured to deliver (``CapacityLimit``): the larger of
    throughput x target latency (Little's law) and the weight in flight the model has been seen
    to carry without queueing (judged by its time to first token). ``budget`` caps it; without
    ``adaptive`` the cap is the limit.

``WeightWindow`` is the in-process window (sync, no awaits). ``RedisWeightWindow`` has the same
methods as coroutines and enforces one budget across gateway replicas with a Redis sorted set and
an atomic Lua script; when Redis is unreachable it falls back to its local ``WeightWindow``.

The package
    ``load``: the engines' own load reports (WatchLoad) as the gateway keeps them, and the
    predicted queue wait; ``controller``: the admission decision, the one ``AdmissionController``
    the request path calls; ``window`` and ``redis_window``: the sliding window and its Redis twin
    behind one interface (``Window``); ``reservations``: ``Hold`` and ``Ticket``; ``capacity``: the
    learned in-flight limit, the fallback for a backend that reports nothing; ``config``: the
    vocabulary.
"""

from services.gateway.admission.capacity import CapacityLimit
from services.gateway.admission.config import (
    BATCH,
    DEFAULT_LANES,
    INTERACTIVE,
    REASON_BUDGET,
    REASON_DEADLINE,
    REASON_IN_FLIGHT,
    REASON_QUEUE_WAIT,
    REASON_TENANT,
    REASON_TOO_HEAVY,
    SOURCE_FALLBACK,
    SOURCE_LOCAL,
    SOURCE_REDIS,
    Admission,
    AdmissionConfig,
    RequestTooHeavy,
    parse_budget,
    parse_lane_shares,
    parse_share,
    parse_tenant_budgets,
    request_weight,
)
from services.gateway.admission.controller import AdmissionController, Ask, Window
from services.gateway.admission.load import LoadBook, ModelLoad, ReplicaReport
from services.gateway.admission.redis_window import ADMIT_LUA, RedisWeightWindow, connect_redis
from services.gateway.admission.reservations import Hold, Ticket
from services.gateway.admission.window import WeightWindow

__all__ = [
    "ADMIT_LUA",
    "BATCH",
    "DEFAULT_LANES",
    "INTERACTIVE",
    "REASON_BUDGET",
    "REASON_DEADLINE",
    "REASON_IN_FLIGHT",
    "REASON_QUEUE_WAIT",
    "REASON_TENANT",
    "REASON_TOO_HEAVY",
    "SOURCE_FALLBACK",
    "SOURCE_LOCAL",
    "SOURCE_REDIS",
    "Admission",
    "AdmissionConfig",
    "AdmissionController",
    "Ask",
    "CapacityLimit",
    "Hold",
    "LoadBook",
    "ModelLoad",
    "RedisWeightWindow",
    "ReplicaReport",
    "RequestTooHeavy",
    "Ticket",
    "WeightWindow",
    "Window",
    "connect_redis",
    "parse_budget",
    "parse_lane_shares",
    "parse_share",
    "parse_tenant_budgets",
    "request_weight",
]

"""Admission's vocabulary: its configuration, request weight, what an admission and a refusal
say. Shared by the window (window.py), its Redis twin (redis_window.py) and the controller."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmesh.errors import LlmeshError, ResourceExhausted
from llmesh.settings import (  # parsers live with the settings; re-exported here
    NAME_PATTERN,
    AdmissionSettings,
    parse_budget,
    parse_lane_shares,
    parse_share,
    parse_tenant_budgets,
)

if TYPE_CHECKING:
    from services.gateway.admission.reservations import Ticket

INTERACTIVE = "interactive"
BATCH = "batch"
DEFAULT_LANES: Mapping[str, float] = {INTERACTIVE: 1.0, BATCH: 0.5}

REASON_BUDGET = "WEIGHT_BUDGET_EXCEEDED"
REASON_TENANT = "TENANT_BUDGET_EXCEEDED"
REASON_TOO_HEAVY = "REQUEST_TOO_HEAVY"
REASON_IN_FLIGHT = "IN_FLIGHT_LIMIT"
REASON_DEADLINE = "DEADLINE_TOO_SHORT"
# No replica the request may go to can start it within its time budget.
REASON_QUEUE_WAIT = "QUEUE_WAIT_TOO_LONG"

SOURCE_LOCAL = "local"
SOURCE_REDIS = "redis"
SOURCE_FALLBACK = "local_fallback"


def request_weight(input_tokens: int, max_new_tokens: int) -> int:
    """The admission weight of one generation request."""
    return max(1, int(input_tokens)) * max(1, int(max_new_tokens))


# --- configuration and results -------------------------------------------------------------------


@dataclass(frozen=True)
class AdmissionConfig:
    budget: float
    window_seconds: float = 10.0
    tenant_share: float = 0.5
    tenant_budgets: Mapping[str, float] = field(default_factory=dict)
    lanes: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_LANES))
    degrade: bool = True
    min_new_tokens: int = 16
    adaptive: bool = False
    target_seconds: float = 3.0
    initial_in_flight: float = 65536.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.budget) and self.budget > 0):
            raise ValueError(f"budget must be a finite number > 0, got {self.budget!r}")
        if not (math.isfinite(self.window_seconds) and self.window_seconds > 0):
            raise ValueError(f"window_seconds must be > 0, got {self.window_seconds!r}")
        if not 0 < self.tenant_share <= 1:
            raise ValueError(f"tenant_share must be in (0, 1], got {self.tenant_share!r}")
        if not self.lanes:
            raise ValueError("at least one lane is required")
        for name, share in self.lanes.items():
            if not NAME_PATTERN.match(name) or not 0 < share <= 1:
                raise ValueError(f"lane {name!r}: share must be in (0, 1], got {share!r}")
        for name, value in self.tenant_budgets.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"tenant {name!r}: budget must be > 0, got {value!r}")
        if self.min_new_tokens < 1:
            raise ValueError(f"min_new_tokens must be >= 1, got {self.min_new_tokens!r}")
        object.__setattr__(self, "tenant_budgets", dict(self.tenant_budgets))
        object.__setattr__(self, "lanes", dict(self.lanes))

    @classmethod
    def from_settings(cls, settings: AdmissionSettings) -> AdmissionConfig:
        """From the gateway's LLMESH_ADMISSION_* settings."""
        return cls(
            budget=settings.budget,
            window_seconds=settings.window_seconds,
            tenant_share=settings.tenant_share,
            tenant_budgets=settings.tenant_budgets,
            lanes=settings.lanes,
            degrade=settings.degrade,
            min_new_tokens=settings.min_new_tokens,
            adaptive=settings.adaptive,
            target_seconds=settings.target_seconds,
            initial_in_flight=settings.initial_in_flight,
        )

    def lane_limit(self, lane: str) -> float:
        try:
            return self.budget * self.lanes[lane]
        except KeyError:
            raise ValueError(f"unknown lane {lane!r} (known: {', '.join(self.lanes)})") from None

    def tenant_limit(self, tenant: str | None) -> float:
        """The tenant's budget; ``None`` means a tenant without an explicit override."""
        explicit = self.tenant_budgets.get(tenant) if tenant is not None else None
        return min(self.budget, explicit if explicit is not None else self.tenant_share * self.budget)

    def max_weight(self, tenant: str | None = None, lane: str = INTERACTIVE) -> float:
        """The heaviest request the tenant can ever be admitted on this lane."""
        return min(self.lane_limit(lane), self.tenant_limit(tenant))


@dataclass(frozen=True)
class Admission:
    """An admitted request. ``occupancy``/``tenant_occupancy`` include it."""

    tenant: str
    lane: str
    weight: int
    occupancy: float
    budget: float
    tenant_occupancy: float
    tenant_budget: float
    max_new_tokens: int | None = None  # set by plan(): the (possibly capped) value to generate with
    degraded: bool = False  # plan() capped max_new_tokens
    source: str = SOURCE_LOCAL  # local | redis | local_fallback
    admitted: bool = True
    # The reservation to report progress on and finish (plan() only).
    ticket: Ticket | None = field(default=None, compare=False)


class RequestTooHeavy(ResourceExhausted):
    """The request exceeds the whole budget it is subject to: it can never be admitted, so no retry
    pushback is sent. The gateway may map it to INVALID_ARGUMENT instead."""

    def __init__(self, message: str, *, metadata: Mapping[str, str]) -> None:
        super().__init__(message, retry_after=0.0, reason=REASON_TOO_HEAVY, metadata=metadata)

    def details(self) -> list[Any]:
        return LlmeshError.details(self)  # ErrorInfo only, no RetryInfo

    def trailing_metadata(self) -> list[tuple[str, str | bytes]]:
        return LlmeshError.trailing_metadata(self)  # no grpc-retry-pushback-ms


def weight_text(value: float) -> str:
    """Exact text of a weight: '100' for integral values, else the shortest round-trip float."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass(frozen=True)
class WeightRequest:
    """One request as a window weighs it (both windows, local and Redis, read it)."""

    tenant: str
    lane: str
    unit: int  # weight per generated token (or the whole weight for admit())
    want: int  # max_new_tokens asked for (1 for admit())
    least: int  # smallest acceptable max_new_tokens
    planned: bool  # from plan(): report max_new_tokens


def weight_request(
    config: AdmissionConfig, tenant: str, unit: int, want: int, lane: str, degrade: bool, planned: bool
) -> WeightRequest:
    """The request as a window weighs it; RequestTooHeavy when even its least acceptable
    generation could never fit what the tenant may use on the lane."""
    if unit < 1 or want < 1:
        raise ValueError("weight must be >= 1")
    least = min(want, config.min_new_tokens) if degrade else want
    req = WeightRequest(tenant, lane, unit, want, least, planned)
    cap = config.max_weight(tenant, lane)  # also validates the lane
    if unit * least > cap:
        meta = {
            "weight": str(unit * want),
            "max_weight": weight_text(cap),
            "tenant": tenant,
            "lane": lane,
        }
        text = (
            f"request weight {unit * least} exceeds {weight_text(cap)}, the most tenant {tenant!r} "
            f"may ever use on lane {lane!r}"
        )
        if planned:
            meta["max_new_tokens_limit"] = str(int(cap // unit))
            text += f"; max_new_tokens would have to be <= {int(cap // unit)}"
        raise RequestTooHeavy(text, metadata=meta)
    return req


def window_refusal(
    config: AdmissionConfig,
    req: WeightRequest,
    scope: str,
    occupancy: float,
    retry_after: float,
    flight_limit: float = math.inf,
) -> ResourceExhausted:
    """The refusal a window answers with: which limit (`scope`: the lane's budget, the tenant's,
    the weight in flight) was full, and when to retry."""
    weight = req.unit * req.least
    if scope == "in_flight":
        limit, reason, what = flight_limit, REASON_IN_FLIGHT, "in flight"
        text = (
            f"{what}: weight {weight} + {weight_text(round(occupancy))} in flight exceeds the limit "
            f"{weight_text(round(limit))}"
        )
    else:
        limit = config.tenant_limit(req.tenant) if scope == "tenant" else config.lane_limit(req.lane)
        reason = REASON_TENANT if scope == "tenant" else REASON_BUDGET
        what = f"tenant {req.tenant!r}" if scope == "tenant" else f"lane {req.lane!r}"
        text = (
            f"{what}: weight {weight} + {weight_text(occupancy)} admitted in the last {config.window_seconds:g}s "
            f"or on its way exceeds {weight_text(limit)}"
        )
    return ResourceExhausted(
        f"{text}; retry in {retry_after:.3f}s",
        retry_after=retry_after,
        reason=reason,
        metadata={
            "weight": str(weight),
            "occupancy": weight_text(round(occupancy) if scope == "in_flight" else occupancy),
            "budget": weight_text(round(limit) if scope == "in_flight" else limit),
            "scope": scope,
            "tenant": req.tenant,
            "lane": req.lane,
        },
    )


__all__ = [
    "parse_budget",
    "parse_lane_shares",
    "parse_share",
    "parse_tenant_budgets",
]

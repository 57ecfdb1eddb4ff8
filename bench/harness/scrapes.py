"""What the bench reads off the services' Prometheus endpoints: gauges, histograms and the
gateway's breaker states while a fault runs."""

from __future__ import annotations

import asyncio
import urllib.request
from collections import Counter
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from bench.harness.load import now
from llmesh.supervisor import Mesh


def samples(port: int) -> list[Sample]:
    """Every sample a Prometheus endpoint on loopback serves (empty when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return []
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def gauge(port: int, name: str) -> float | None:
    """One unlabelled sample from a Prometheus endpoint."""
    return next((s.value for s in samples(port) if s.name == name and not s.labels), None)


def histogram(port: int, name: str) -> dict[float, float]:
    """The cumulative bucket counts of one unlabelled histogram, by upper bound."""
    return {float(s.labels["le"]): s.value for s in samples(port) if s.name == name + "_bucket" and "le" in s.labels}


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The upper bound of the bucket holding quantile `q` of the samples taken between two scrapes."""
    counts = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    if not counts or counts[-1][1] <= 0:
        return None
    for bound, count in counts:
        if count >= q * counts[-1][1]:
            return bound
    return None


ADMISSION_GAUGES = {
    "llmesh_gateway_admission_in_flight_limit": "limit",
    "llmesh_gateway_admission_in_flight": "in_flight",
    "llmesh_gateway_admission_throughput": "throughput",
}


def scrape(port: int) -> dict[str, Any]:
    """Breaker states, transition counts and the admission gauges from the gateway's Prometheus
    endpoint. OSError when it does not answer."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
        text = reply.read().decode()
    states: dict[str, int] = {}
    transitions: dict[str, float] = {}
    admission: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ADMISSION_GAUGES and not s.labels:
                admission[ADMISSION_GAUGES[s.name]] = round(s.value, 1)
            elif s.name == "llmesh_gateway_breaker_state":
                states[s.labels["peer"]] = int(s.value)
            elif s.name == "llmesh_gateway_breaker_transitions_total":
                transitions[f"{s.labels['peer']}:{s.labels['from_state']}->{s.labels['to_state']}"] = s.value
    return {"states": states, "transitions": transitions, "admission": admission}


class BreakerWatch:
    """Polls the gateway's breaker states during a fault (the gateway may be restarted meanwhile)."""

    def __init__(self, mesh: Mesh, interval: float = 0.2) -> None:
        self.mesh = mesh
        self.interval = interval
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.admission: list[tuple[float, dict[str, float]]] = []
        # Transition counters per gateway process: (first seen, last seen). A process started while
        # watching counts from 0; the one already running counts from the first scrape.
        self.counters: dict[int, tuple[dict[str, float], dict[str, float]]] = {}
        self._task: asyncio.Task[None] | None = None

    def _scrape(self) -> tuple[int, dict[str, Any]] | None:
        proc = self.mesh.procs.get("gateway")
        if proc is None or not proc.metrics_port:
            return None
        try:
            return proc.proc.pid, scrape(proc.metrics_port)
        except OSError:
            return None

    async def _poll(self) -> None:
        while True:
            found = await asyncio.to_thread(self._scrape)
            if found is not None:
                pid, metrics = found
                self.samples.append((now(), metrics["states"]))
                self.admission.append((now(), metrics["admission"]))
                first = {} if self.counters else dict(metrics["transitions"])
                self.counters.setdefault(pid, (first, {}))[1].update(metrics["transitions"])
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def transitions(self) -> dict[str, int]:
        """Breaker state changes counted while watching, as "peer:from->to"."""
        total: Counter[str] = Counter()
        for first, last in self.counters.values():
            for key, value in last.items():
                total[key] += int(value - first.get(key, 0.0))
        return {k: v for k, v in sorted(total.items()) if v > 0}

    def closed_since(self, peer: str, t: float) -> float | None:
        """Seconds from t until the peer's breaker was closed in every later sample (None: never)."""
        after = [(ts, s.get(peer, 0)) for ts, s in self.samples if ts >= t]
        if not after:
            return None
        closed_at = None
        for ts, state in after:
            if state == 0:
                closed_at = ts if closed_at is None else closed_at
            else:
                closed_at = None
        return None if closed_at is None else max(0.0, closed_at - t)

    def opened(self, peer: str) -> bool:
        return any(s.get(peer, 0) != 0 for _, s in self.samples)

"""Prometheus scrape config, Grafana provisioning and the llmesh dashboard: every service's
metrics port is scraped, the provisioning points where compose mounts things, and the
dashboard queries metrics that the code defines (for the services implemented so far)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmesh import settings

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "llmesh.json"
COMPOSE = ROOT / "docker-compose.yml"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers and by/without clauses removed)."""
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)
    return set(re.findall(r"\b((?:llmesh|grpc)_[a-z0-9_]+)\b", expr))


def base_name(metric: str) -> str:
    return re.sub(r"_(bucket|sum|count|total|created)$", "", metric)


def test_prometheus_scrapes_every_service_and_itself() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]] for job in config["scrape_configs"]
    }
    assert targets["prometheus"] == ["localhost:9090"]
    for name in settings.SERVICES:
        assert targets[name][0] == f"{name}:{settings.DEFAULT_METRICS_PORTS[name]}", name
    # Every model's inference service (compose's LLMESH_MODELS) is scraped in the inference job.
    gateway = yaml.safe_load(COMPOSE.read_text())["services"]["gateway"]["environment"]
    hosts = [t.rpartition(":")[0] for t in settings.parse_models(gateway["LLMESH_MODELS"]).values()]
    port = settings.DEFAULT_METRICS_PORTS["inference"]
    assert targets["inference"] == [f"{host}:{port}" for host in hosts]


def test_prometheus_config_is_mounted_by_compose() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    volumes = compose["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in volumes
    assert "--config.file=/etc/prometheus/prometheus.yml" in compose["prometheus"]["command"]


def test_grafana_provisioning_matches_compose_mounts(dashboard: dict[str, Any]) -> None:
    compose = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in compose["volumes"] if v.startswith("./")}
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "llmesh.yml").read_text())["providers"]
    assert providers[0]["options"]["path"] == mounts["./deploy/grafana/dashboards"]
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "llmesh.yml").read_text())["datasources"]
    by_uid = {s["uid"]: s for s in sources}
    assert by_uid["prometheus"]["url"] == "http://prometheus:9090" and by_uid["prometheus"]["isDefault"]
    assert by_uid["jaeger"]["url"] == "http://jaeger:16686"
    exemplar = by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"][0]
    assert exemplar["datasourceUid"] == "jaeger"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"


def test_dashboard_structure(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "llmesh"
    all_panels = panels(dashboard)
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in all_panels:
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys(), panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_dashboard_covers_the_required_metrics(dashboard: dict[str, Any]) -> None:
    exprs = "\n".join(expressions(dashboard))
    for needle in (
        "grpc_server_handling_seconds_bucket",
        "histogram_quantile(0.5,",
        "histogram_quantile(0.95,",
        "histogram_quantile(0.99,",
        "llmesh_gateway_requests_total",
        "by (outcome)",
        "by (cache_tier)",
        "llmesh_gateway_admission_weight",
        "llmesh_gateway_shed_total",
        "llmesh_gateway_breaker_state",
        "llmesh_inference_queue_size",
        "llmesh_inference_batch_size",
        "llmesh_inference_time_to_first_token_seconds_bucket",
        "llmesh_inference_inter_token_latency_seconds_bucket",
        "llmesh_inference_generation_tokens_total",
        "llmesh_cache_lookups_total",
        "by (tier, result)",
        "llmesh_cache_semantic_rejections_total",
        "llmesh_retrieval_search_duration_seconds_bucket",
        "llmesh_retrieval_points",
    ):
        assert needle in exprs, f"dashboard does not query {needle}"


def _registered_metric_names(packages: list[str]) -> set[str]:
    from prometheus_client import REGISTRY

    importlib.import_module("llmesh.metrics")
    for package in packages:
        module = importlib.import_module(package)
        for info in pkgutil.walk_packages(module.__path__, package + "."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    return {metric.name for metric in REGISTRY.collect()}


def test_dashboard_metrics_exist_in_the_code(dashboard: dict[str, Any]) -> None:
    """The metric names the dashboard queries are registered by the code: llmesh.metrics (gRPC
    server metrics) and every service that already registers llmesh_<service>_* metrics (a
    service not instrumented yet is left out until it is)."""
    packages = [f"services.{s}" for s in settings.SERVICES if (ROOT / "services" / s / "__init__.py").is_file()]
    registered = _registered_metric_names(packages)
    instrumented = [s for s in settings.SERVICES if any(m.startswith(f"llmesh_{s}_") for m in registered)]
    used = {base_name(m) for expr in expressions(dashboard) for m in metric_names(expr)}
    checked = {m for m in used if m.startswith("grpc_")}
    checked |= {m for m in used if any(m.startswith(f"llmesh_{s}_") for s in instrumented)}
    assert {"grpc_server_handled", "grpc_server_handling_seconds"} <= checked
    missing = sorted(m for m in checked if m not in registered)
    assert not missing, f"the dashboard queries metrics that no code registers: {missing}"


def test_dashboard_has_a_panel_per_tenant(dashboard: dict[str, Any]) -> None:
    """A shared service: a Tenant variable over the usage counters, and a panel repeated for each
    tenant with the tokens it used and the tokens the cache saved it."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "llmesh_gateway_tenant_requests_total, tenant" in variables["tenant"]["definition"]
    repeated = [p for p in panels(dashboard) if p.get("repeat") == "tenant"]
    assert len(repeated) == 1
    exprs = " ".join(t["expr"] for t in repeated[0]["targets"])
    for metric in ("input_tokens", "output_tokens", "saved_tokens"):
        assert f'llmesh_gateway_tenant_{metric}_total{{tenant=~"$tenant"}}' in exprs, metric
    limited = "\n".join(expressions(dashboard))
    assert "llmesh_gateway_tenant_key_limited_total" in limited and "llmesh_gateway_tenant_shed_total" in limited

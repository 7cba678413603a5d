"""deploy/k8s: every manifest valid against the Kubernetes schemas (offline), and the properties the
deployment relies on (GPU requests, probes, rollout strategy, secrets, scrape annotations)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from services.core.config.run import SERVICE_NAMES, parse_config

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# The schema version manifests are checked against: the oldest Kubernetes release still maintained
# that has everything used here (gRPC probes are GA since 1.27).
K8S_VERSION = "1.30.0"


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                out.append((f.name, doc))
    return out


DOCS = _docs()
BY_KIND: dict[tuple[str, str], dict[str, Any]] = {(d["kind"], d["metadata"]["name"]): d for _, d in DOCS}


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS])
def test_manifest_is_valid_against_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate (ships the Kubernetes JSON schemas; works offline) is not installed:"
               " pip install kubernetes-validate, or the dev extras")
    try:
        kv.validate(doc, K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {e.message} at {'/'.join(map(str, e.path))}")


def test_kustomization_lists_every_manifest_but_the_example_secret() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert set(kust["resources"]) == files
    for f, d in DOCS:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == kust["namespace"], f


def _deployment(name: str) -> dict[str, Any]:
    return BY_KIND[("Deployment", name)]


def _container(name: str) -> dict[str, Any]:
    return _deployment(name)["spec"]["template"]["spec"]["containers"][0]


def _config() -> Any:
    cm = BY_KIND[("ConfigMap", "rlfleet-config")]
    return parse_config(yaml.safe_load(cm["data"]["config.yaml"]), source="configmap")


def test_one_deployment_per_service_with_probes_ports_and_scrape_annotations() -> None:
    cfg = _config()
    for name in SERVICE_NAMES:
        dep = _deployment(name)
        pod = dep["spec"]["template"]
        c = _container(name)
        ep = cfg.endpoint(name)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": ep.grpc_port, "http": ep.http_port}, name
        assert c["readinessProbe"]["grpc"]["port"] == ep.grpc_port, name  # grpc.health.v1
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", name
        ann = pod["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(ep.http_port), name
        assert ann["prometheus.io/path"] == "/metrics"
        # The address in the config is the pod's own name under the headless service.
        assert ep.host == f"{pod['spec']['hostname']}.{pod['spec']['subdomain']}", name
        assert c["args"] == ["--config", "/var/lib/rlfleet/run/fleet.yaml"]
        assert c["image"].startswith(f"rlfleet/{name}:")
        sec = pod["spec"]["securityContext"]
        assert sec["runAsNonRoot"] is True and sec["runAsUser"] != 0


def test_gpu_services_request_gpus_and_the_controller_does_not() -> None:
    for name in ("actor", "critic", "reference"):
        res = _container(name)["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] >= 1, name
    for name in ("controller",):
        res = _container(name)["resources"]
        assert "nvidia.com/gpu" not in res.get("limits", {}) and "nvidia.com/gpu" not in res.get("requests", {})


def test_scorers_roll_without_unavailability_and_have_disruption_budgets() -> None:
    for name in ("reward", "reference"):
        spec = _deployment(name)["spec"]
        assert spec["strategy"]["type"] == "RollingUpdate"
        assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        assert spec["replicas"] >= 2
        pdb = BY_KIND[("PodDisruptionBudget", name)]
        assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
        assert pdb["spec"]["minAvailable"] >= 1
    for name in ("controller", "actor", "critic"):
        assert _deployment(name)["spec"]["strategy"]["type"] == "Recreate"


def test_secrets_reach_the_env_vars_the_config_names() -> None:
    cfg = _config()
    names = {cfg.security.token_env, cfg.redis.password_env}
    assert None not in names
    for name in SERVICE_NAMES:
        env = {e["name"]: e for e in _container(name)["env"]}
        for var in names:
            assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "rlfleet-secrets", "key": var}, (name, var)
    secret = BY_KIND[("Secret", "rlfleet-secrets")]
    assert set(secret["stringData"]) == names


def test_redis_statefulset_persists_with_aof_and_never_evicts() -> None:
    sts = BY_KIND[("StatefulSet", "redis")]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    cmd = " ".join(c["command"])
    assert "--appendonly yes" in cmd and "--maxmemory-policy noeviction" in cmd and "--requirepass" in cmd
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == c["volumeMounts"][0]["name"]
    assert _config().redis.url == "redis://redis:6379/0"
    assert ("Service", "redis") in BY_KIND


def test_headless_service_publishes_pod_names_before_ready() -> None:
    svc = BY_KIND[("Service", "rlfleet-pods")]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    for name in SERVICE_NAMES:
        labels = _deployment(name)["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()), name


def test_journal_on_its_own_volume_mounted_by_the_controller_only() -> None:
    cfg = _config()
    assert str(cfg.journal_dir) == "/var/lib/rlfleet/journal"
    for name in SERVICE_NAMES:
        vols = {v["name"]: v for v in _deployment(name)["spec"]["template"]["spec"]["volumes"]}
        has = any(v.get("persistentVolumeClaim", {}).get("claimName") == "rlfleet-journal" for v in vols.values())
        assert has == (name == "controller"), name

"""deploy/k8s/multihost: the actor over several hosts as one LeaderWorkerSet group, checked offline:
the LWS fields against a schema written from the LWS v1 CRD (tests/deploy/schemas), its pod templates
against the Kubernetes schemas, and the properties the fleet relies on (a dead rank restarts the whole
group, workers find rank 0, the overlay's config differs from the base only in the actor's address)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from services.core.config.run import parse_config

ROOT = Path(__file__).resolve().parents[2]
MULTI = ROOT / "deploy" / "k8s" / "multihost"
SCHEMA = json.loads((Path(__file__).parent / "schemas" / "leaderworkerset-v1.json").read_text())
K8S_VERSION = "1.30.0"


def _lws() -> dict[str, Any]:
    return yaml.safe_load((MULTI / "actor-lws.yaml").read_text())  # type: ignore[no-any-return]


def _tpl(which: str) -> dict[str, Any]:
    return _lws()["spec"]["leaderWorkerTemplate"][which]  # type: ignore[no-any-return]


def _config(path: Path) -> Any:
    return yaml.safe_load(yaml.safe_load(path.read_text())["data"]["config.yaml"])


def test_leaderworkerset_matches_the_crd_schema_and_a_typo_does_not() -> None:
    jsonschema.validate(_lws(), SCHEMA)
    bad = copy.deepcopy(_lws())
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnRestart"  # the docs' old spelling
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)
    bad = copy.deepcopy(_lws())
    bad["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)


@pytest.mark.parametrize("which", ["leaderTemplate", "workerTemplate"])
def test_pod_templates_are_valid_kubernetes_pod_templates(which: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (dev extras)")
    doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"actor-{which}", "namespace": "rlfleet"},
           "template": _tpl(which)}
    try:
        kv.validate(doc, K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        pytest.fail(f"{which}: {e.message} at {'/'.join(map(str, e.path))}")


def test_a_dead_rank_restarts_the_whole_group_and_workers_find_rank_0() -> None:
    spec = _lws()["spec"]
    lwt = spec["leaderWorkerTemplate"]
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    # The leader becomes ready only once its workers joined: LeaderReady would never start them.
    assert spec["startupPolicy"] == "LeaderCreated"
    assert lwt["size"] >= 2 and spec["replicas"] == 1  # one actor, several hosts
    leader, worker = _tpl("leaderTemplate")["spec"]["containers"][0], _tpl("workerTemplate")["spec"]["containers"][0]
    gpus = {c["resources"]["limits"]["nvidia.com/gpu"] for c in (leader, worker)}
    assert len(gpus) == 1 and all(c["resources"]["requests"]["nvidia.com/gpu"] in gpus for c in (leader, worker))
    args = " ".join(worker["args"])
    assert "$(LWS_LEADER_ADDRESS)" in args and "$(LWS_WORKER_INDEX)" in args and "$(LWS_GROUP_SIZE)" in args
    store = {p["name"]: p["containerPort"] for p in leader["ports"]}["dist-store"]
    assert f"--store-port {store}" in args
    env = {e["name"]: e.get("value") for e in leader["env"]}
    assert env["RLFLEET_DIST_STORE_PORT"] == str(store) and env["RLFLEET_DIST_NODES"] == "$(LWS_GROUP_SIZE)"


def test_the_leader_is_the_base_actor_pod_at_the_address_the_overlay_config_names() -> None:
    base = yaml.safe_load((ROOT / "deploy" / "k8s" / "actor.yaml").read_text())["spec"]["template"]["spec"]
    leader = _tpl("leaderTemplate")["spec"]
    b, c = base["containers"][0], leader["containers"][0]
    for key in ("image", "args", "readinessProbe", "livenessProbe", "startupProbe", "volumeMounts"):
        assert c[key] == b[key], key
    assert leader["initContainers"] == base["initContainers"] and leader["volumes"] == base["volumes"]
    over, orig = _config(MULTI / "configmap-patch.yaml"), _config(ROOT / "deploy" / "k8s" / "configmap.yaml")
    # LWS names the leader pod <name>-0 under a headless Service <name> (subdomainPolicy Shared).
    assert over["services"]["actor"]["host"] == f"{_lws()['metadata']['name']}-0.actor"
    over["services"]["actor"]["host"] = orig["services"]["actor"]["host"]
    assert over == orig, "the overlay's config drifted from deploy/k8s/configmap.yaml"
    parse_config(_config(MULTI / "configmap-patch.yaml"), source="multihost configmap")


def test_overlay_replaces_the_actor_deployment_with_the_leaderworkerset() -> None:
    kust = yaml.safe_load((MULTI / "kustomization.yaml").read_text())
    assert kust["resources"] == ["..", "actor-lws.yaml", "network-policy.yaml"]
    patches = {p["path"] for p in kust["patches"]}
    assert patches == {"delete-actor-deployment.yaml", "configmap-patch.yaml"}
    delete = yaml.safe_load((MULTI / "delete-actor-deployment.yaml").read_text())
    base = yaml.safe_load((ROOT / "deploy" / "k8s" / "actor.yaml").read_text())
    assert delete["$patch"] == "delete"
    assert (delete["kind"], delete["metadata"]) == (base["kind"], {"name": "actor", "namespace": "rlfleet"})


def _policy() -> dict[str, Any]:
    return yaml.safe_load((MULTI / "network-policy.yaml").read_text())  # type: ignore[no-any-return]


def test_the_network_policy_is_valid_kubernetes() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (dev extras)")
    try:
        kv.validate(_policy(), K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        pytest.fail(f"{e.message} at {'/'.join(map(str, e.path))}")


def test_only_the_groups_own_pods_reach_the_store_and_the_collectives() -> None:
    """Every rule that opens the store port (or every port) admits the group's pods and nothing else;
    the rest of the fleet gets the actor's gRPC and HTTP ports."""
    spec, lws = _policy()["spec"], _lws()
    group = {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}  # the label LWS puts on its pods
    assert spec["podSelector"] == {"matchLabels": group} and spec["policyTypes"] == ["Ingress"]
    leader = _tpl("leaderTemplate")["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    opened: dict[int, list[Any]] = {}
    for rule in spec["ingress"]:
        sources = rule.get("from")  # absent: from anywhere
        for port in [p["port"] for p in rule.get("ports", [])] or ["all"]:
            opened.setdefault(port, []).append(sources)
    for port in ("all", ports["dist-store"]):
        for sources in opened.get(port, []):
            assert sources == [{"podSelector": {"matchLabels": group}}], (port, sources)
    assert ports["dist-store"] not in opened and "all" in opened  # the store only through the group rule
    assert opened[ports["grpc"]] == [[{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "rlfleet"}}}]]
    assert opened[ports["http"]] == [None]

"""Multi-GPU device groups end to end through placement: what `rlfleet plan` resolves, what `rlfleet up`
puts in each process's CUDA_VISIBLE_DEVICES, what docker compose reserves per container, and the
nvidia.com/gpu count each Kubernetes pod asks for. A synthetic 8-GPU inventory file, no NVML."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from services.core.config.run import RunConfig, parse_config
from services.core.host.placement import Inventory
from services.plan import make_plan, plan_main

ROOT = Path(__file__).resolve().parents[2]
H200 = [{"index": i, "name": "NVIDIA H200", "memory_gb": 141, "arch": "hopper", "uuid": f"GPU-{i:04d}"}
        for i in range(8)]

DECOUPLED: dict[str, Any] = {
    "algo": {"name": "ppo", "kl_coef": 0.05},
    "generation": {"engine": "vllm", "device": "cuda", "replicas": 2, "tensor_parallel_size": 2},
    "devices": {"train": {"count": 4}, "value": {"count": 2}, "score": {"ids": [6, 7]}},
    "services": {"actor": {"device_group": "train", "device": "cuda", "trainer_ranks": 4},
                 "critic": {"device_group": "value", "device": "cuda", "trainer_ranks": 2},
                 "reward": {"device_group": "score", "device": "cuda", "replicas": 2},
                 "reference": {"device_group": "score", "device": "cuda"}},
}


def _cfg(tmp_path: Path, data: dict[str, Any] = DECOUPLED) -> RunConfig:
    return parse_config({**data, "run": {"dir": str(tmp_path / "run")}})


def test_a_group_of_four_gpus_is_one_actor_process_seeing_all_four(tmp_path: Path) -> None:
    plan = make_plan(_cfg(tmp_path), Inventory.synthetic(H200))
    assert plan.gpu_ids("actor") == "0,1,2,3" and plan.gpu_ids("critic") == "4,5"
    assert plan.service_env("actor")["CUDA_VISIBLE_DEVICES"] == "GPU-0000,GPU-0001,GPU-0002,GPU-0003"
    assert plan.per_replica_gpu_count("actor") == 4
    notes = "\n".join(plan.notes)
    assert "actor: 4 trainer rank(s) on GPUs 0,1,2,3" in notes
    assert "2 engine replica(s) x tensor_parallel_size 2: replica 0 on GPU 0,1; replica 1 on GPU 2,3" in notes
    assert "critic: 2 trainer rank(s) on GPUs 4,5" in notes


def test_scorer_replicas_on_a_group_get_one_gpu_each_from_rlfleet_up(tmp_path: Path) -> None:
    from services.fleet import Fleet

    fleet = Fleet(_cfg(tmp_path), inventory=Inventory.synthetic(H200))
    fleet.plan = fleet.place(fleet.base_cfg)
    assert [fleet.service_env("reward", r)["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == ["GPU-0006", "GPU-0007"]
    assert fleet.service_env("reference")["CUDA_VISIBLE_DEVICES"] == "GPU-0006,GPU-0007"  # one process: both
    assert fleet.service_env("actor", 0)["CUDA_VISIBLE_DEVICES"].count(",") == 3


def test_replicas_sharing_one_gpu_split_its_memory(tmp_path: Path) -> None:
    data = {"generation": {"engine": "vllm", "device": "cuda", "replicas": 2},
            "devices": {"one": {"ids": [5]}}, "services": {"actor": {"device_group": "one", "device": "cuda"}}}
    plan = make_plan(_cfg(tmp_path, data), Inventory.synthetic(H200))
    assert "replica 0 on GPU 5; replica 1 on GPU 5 (sharing: each takes 0.5 of" in "\n".join(plan.notes)


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:?message} / ${VAR:-default} substitution, for the variables the plan writes."""
    def sub(m: re.Match[str]) -> str:
        name, op, rest = m.group(1), m.group(2) or "", m.group(3) or ""
        if name in env:
            return env[name]
        assert not name.endswith("_GPUS"), f"{name}: the plan did not write it"
        return "set-by-the-operator" if op == ":?" else rest
    return re.sub(r"\$\{([A-Z_]+)(:\?|:-)?([^}]*)\}", sub, text)


def test_compose_gives_each_container_its_group_and_k8s_pods_their_gpu_count(tmp_path: Path) -> None:
    config, inv = tmp_path / "fleet.yaml", tmp_path / "inv.yaml"
    config.write_text(yaml.safe_dump({**DECOUPLED, "run": {"dir": str(tmp_path / "run")}}))
    inv.write_text(yaml.safe_dump({"gpus": H200}))
    env_file, patch = tmp_path / "plan.env", tmp_path / "gpus.patch.yaml"
    assert plan_main(config, env_file, False, inv, k8s_patch=patch) == 0
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if line and not line.startswith("#"))
    assert env["RLFLEET_ACTOR_GPUS"] == "0,1,2,3" and env["RLFLEET_ACTOR_GPU_COUNT"] == "4"
    compose = yaml.safe_load(_interpolate((ROOT / "docker-compose.yml").read_text(), env))
    # One entry holding the comma list: the NVIDIA runtime joins device_ids with commas into
    # NVIDIA_VISIBLE_DEVICES, so the container sees exactly the group's four GPUs.
    reserved = {name: compose["services"][name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
                for name in ("actor", "critic", "reward", "reference")}
    assert reserved == {"actor": ["0,1,2,3"], "critic": ["4,5"], "reward": ["6,7"], "reference": ["6,7"]}

    pods = {d["metadata"]["name"]: d for d in yaml.safe_load_all(patch.read_text())}
    counts = {n: d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
              for n, d in pods.items()}
    assert counts == {"actor": 4, "critic": 2, "reward": 1, "reference": 2}
    for name, doc in pods.items():  # the patch names what deploy/k8s has: Deployment and container
        base = yaml.safe_load((ROOT / "deploy" / "k8s" / f"{name}.yaml").read_text())
        assert (base["kind"], base["metadata"]["name"], base["metadata"]["namespace"]) == \
            (doc["kind"], name, doc["metadata"]["namespace"])
        assert base["spec"]["template"]["spec"]["containers"][0]["name"] == name


def test_more_trainer_ranks_than_the_groups_gpus_is_a_placement_error(tmp_path: Path) -> None:
    import pytest

    from services.core.host.placement import PlacementError

    data = {**DECOUPLED, "services": {**DECOUPLED["services"],
                                      "critic": {"device_group": "value", "device": "cuda", "trainer_ranks": 3}}}
    with pytest.raises(PlacementError, match=r"services\.critic\.trainer_ranks: 3 ranks on a device group of 2"):
        make_plan(_cfg(tmp_path, data), Inventory.synthetic(H200))

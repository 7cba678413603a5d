"""Placement: device groups against synthetic GPU inventories (no NVML needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from services.core.config.run import DeviceGroup, Endpoint, load_config, parse_config
from services.core.host.placement import (
    Gpu,
    Inventory,
    PlacementError,
    arch_family,
    discover_gpus,
    load_inventory,
    resolve,
)
from services.plan import plan_main

ROOT = Path(__file__).resolve().parents[2]


def gpus(*specs: tuple[float, str]) -> Inventory:
    """Inventory from (memory_gb, arch-or-sm) pairs, indexed 0..n-1."""
    names = {"hopper": "H100", "ampere": "A100", "ada": "L40S", "blackwell": "B200", "turing": "T4"}
    rows = []
    for i, (mem, arch) in enumerate(specs):
        cc = {"hopper": "9.0", "ampere": "8.0", "ada": "8.9", "blackwell": "10.0", "turing": "7.5"}[arch]
        rows.append(Gpu(index=i, name=names[arch], memory_gb=mem, uuid=f"GPU-{i:04d}",
                        compute_capability=cc, arch=arch))
    return Inventory(tuple(rows), source="synthetic")


ONE = gpus((80, "hopper"))
TWO = gpus((80, "hopper"), (40, "ampere"))
FOUR = gpus((24, "ada"), (80, "hopper"), (40, "ampere"), (80, "hopper"))
EIGHT = gpus((80, "ampere"), (80, "ampere"), (40, "ampere"), (40, "ampere"),
             (141, "hopper"), (141, "hopper"), (16, "turing"), (192, "blackwell"))
CPU = Inventory(source="nvml", reason="nvidia-ml-py is not installed")


def groups(**kw: dict[str, Any]) -> dict[str, DeviceGroup]:
    return {name: DeviceGroup(**spec) for name, spec in kw.items()}


def services(**kw: str | None) -> dict[str, Endpoint]:
    return {name: Endpoint(device_group=g) for name, g in kw.items()}


# --- explicit ids ---------------------------------------------------------------------------------


def test_explicit_ids_are_honoured_and_services_share_their_group() -> None:
    plan = resolve(groups(actor_group={"ids": [1, 3]}, scorers={"ids": [0]}),
                   services(actor="actor_group", reward="scorers", reference="scorers", controller=None),
                   FOUR)
    assert plan.groups["actor_group"].ids == [1, 3]
    assert plan.gpu_ids("actor") == "1,3"
    assert plan.gpu_ids("reward") == plan.gpu_ids("reference") == "0"
    assert plan.gpu_ids("controller") == ""
    assert plan.cuda_visible_devices("controller") == ""
    assert plan.cuda_visible_devices("actor") == "GPU-0001,GPU-0003"  # UUIDs: immune to CUDA's ordering


def test_explicit_id_not_present_names_group_and_field() -> None:
    with pytest.raises(PlacementError) as e:
        resolve(groups(actor_group={"ids": [2]}), services(actor="actor_group"), TWO)
    assert str(e.value) == "device group 'actor_group': ids [2] not present (found 0,1)"


def test_explicit_ids_checked_against_the_groups_own_constraints() -> None:
    big = r"device group 'big': ids: GPU 1 \(A100\) has 40 GB, below min_memory_gb 80"
    with pytest.raises(PlacementError, match=big):
        resolve(groups(big={"ids": [0, 1], "min_memory_gb": 80}), services(actor="big"), TWO)
    arch = r"device group 'h': ids: GPU 1 \(A100\) is ampere/sm80, not arch 'hopper'"
    with pytest.raises(PlacementError, match=arch):
        resolve(groups(h={"ids": [1], "arch": "hopper"}), services(actor="h"), TWO)


def test_overlapping_explicit_groups_are_refused() -> None:
    with pytest.raises(PlacementError) as e:
        resolve(groups(a={"ids": [0, 1]}, b={"ids": [1, 2]}), services(actor="a", critic="b"), FOUR)
    assert "device groups 'a' and 'b' overlap: both claim GPU 1" in str(e.value)


# --- count-based ----------------------------------------------------------------------------------


def test_count_groups_pack_disjointly_in_declaration_order_on_eight_gpus() -> None:
    plan = resolve(groups(actor_group={"count": 2}, critic_group={"count": 2}, scorers={"count": 1}),
                   services(actor="actor_group", critic="critic_group", reward="scorers"), EIGHT)
    ids = [plan.groups[g].ids for g in ("actor_group", "critic_group", "scorers")]
    assert ids == [[0, 1], [2, 3], [4]]
    flat = [i for x in ids for i in x]
    assert len(set(flat)) == len(flat)


def test_min_memory_and_arch_are_hard_constraints() -> None:
    plan = resolve(groups(actor_group={"count": 2, "min_memory_gb": 100},
                          scorers={"count": 2, "min_memory_gb": 60, "arch": "ampere"}),
                   services(actor="actor_group", reward="scorers", reference="scorers"), EIGHT)
    assert plan.groups["actor_group"].ids == [4, 5]  # 141 GB hoppers (the 192 GB one is left over)
    assert plan.groups["scorers"].ids == [0, 1]  # the 80 GB amperes, not the 40 GB ones
    for gpu in plan.groups["actor_group"].gpus:
        assert gpu.memory_gb >= 100


def test_arch_accepts_family_sm_and_compute_capability() -> None:
    for spelling in ("hopper", "HOPPER", "sm90", "sm_90", "9.0"):
        plan = resolve(groups(g={"count": 1, "arch": spelling}), services(actor="g"), FOUR)
        assert plan.groups["g"].ids == [1], spelling


def test_a_constrained_group_is_not_starved_by_an_earlier_greedy_group() -> None:
    # 'any' comes first and would grab GPU 0 or 1 greedily; the hopper group needs one of them.
    inv = gpus((80, "hopper"), (40, "ampere"))
    plan = resolve(groups(any={"count": 1}, h={"count": 1, "arch": "hopper"}), services(actor="any", critic="h"), inv)
    assert plan.groups["h"].ids == [0]
    assert plan.groups["any"].ids == [1]


def test_prefer_arch_is_a_soft_preference_when_there_is_a_choice() -> None:
    plan = resolve(groups(actor_group={"count": 2, "prefer_arch": "hopper"}), services(actor="actor_group"), FOUR)
    assert plan.groups["actor_group"].ids == [1, 3]
    assert plan.groups["actor_group"].preferred_met is True
    # Without the wish, the lowest indices.
    plan = resolve(groups(actor_group={"count": 2}), services(actor="actor_group"), FOUR)
    assert plan.groups["actor_group"].ids == [0, 1]


def test_prefer_arch_falls_back_and_says_so() -> None:
    plan = resolve(groups(actor_group={"count": 2, "prefer_arch": "blackwell"}), services(actor="actor_group"), FOUR)
    assert plan.groups["actor_group"].ids == [0, 1]
    assert plan.groups["actor_group"].preferred_met is False
    assert any("prefer_arch 'blackwell' not met" in n for n in plan.notes)


def test_prefer_arch_never_overrides_another_groups_hard_constraint() -> None:
    inv = gpus((80, "hopper"), (80, "hopper"), (40, "ampere"))
    plan = resolve(groups(actor_group={"count": 1, "prefer_arch": "hopper"},
                          critic_group={"count": 2, "arch": "hopper"}),
                   services(actor="actor_group", critic="critic_group"), inv)
    assert plan.groups["critic_group"].ids == [0, 1]
    assert plan.groups["actor_group"].ids == [2]
    assert plan.groups["actor_group"].preferred_met is False


def test_explicit_and_count_groups_mix_without_overlap() -> None:
    plan = resolve(groups(pinned={"ids": [0]}, rest={"count": 3}), services(actor="pinned", critic="rest"), FOUR)
    assert plan.groups["pinned"].ids == [0]
    assert plan.groups["rest"].ids == [1, 2, 3]


# --- refusals -------------------------------------------------------------------------------------


def test_unsatisfiable_group_names_group_field_and_what_is_left() -> None:
    inv = gpus((80, "hopper"), (80, "hopper"), (80, "ampere"), (24, "ada"))
    with pytest.raises(PlacementError) as e:
        resolve(groups(actor_group={"ids": [0]}, scorers={"count": 3, "min_memory_gb": 80, "arch": "hopper"}),
                services(actor="actor_group", reward="scorers"), inv)
    msg = str(e.value)
    assert msg.startswith("device group 'scorers': count 3 needs 3 GPUs with min_memory_gb >= 80 and arch 'hopper'; ")
    assert "this host has 2" in msg


def test_group_starved_by_other_groups_says_how_many_are_left() -> None:
    with pytest.raises(PlacementError) as e:
        resolve(groups(actor_group={"ids": [1]}, scorers={"count": 2, "arch": "hopper"}),
                services(actor="actor_group", reward="scorers"), FOUR)
    assert "device group 'scorers': count 2 needs 2 GPUs with arch 'hopper'; 1 left after other groups" in str(e.value)


def test_counts_that_fit_alone_but_not_together_name_the_group_that_does_not_fit() -> None:
    with pytest.raises(PlacementError) as e:
        resolve(groups(a={"count": 1, "arch": "hopper"}, b={"count": 1, "arch": "hopper"}),
                services(actor="a", critic="b"), TWO)
    assert str(e.value) == "device group 'b': count 1 needs 1 GPU with arch 'hopper'; 0 left after other groups (a: 0)"
    with pytest.raises(PlacementError, match=r"count adds up to 3 GPUs; 2 left"):
        resolve(groups(a={"count": 2}, b={"count": 1}), services(actor="a", critic="b"), TWO)


def test_one_gpu_cannot_host_two_groups() -> None:
    with pytest.raises(PlacementError, match="device group"):
        resolve(groups(a={"count": 1}, b={"count": 1}), services(actor="a", critic="b"), ONE)
    plan = resolve(groups(shared={"count": 1}), services(actor="shared", critic="shared"), ONE)
    assert plan.gpu_ids("actor") == plan.gpu_ids("critic") == "0"


def test_cpu_only_inventory_refuses_gpu_groups_clearly() -> None:
    with pytest.raises(PlacementError) as e:
        resolve(groups(actor_group={"count": 1}), services(actor="actor_group", controller=None), CPU)
    msg = str(e.value)
    assert "'actor_group' (actor)" in msg
    assert "need GPUs but this host has none: nvidia-ml-py is not installed" in msg
    assert "--inventory" in msg


def test_groups_less_config_is_fine_on_cpu() -> None:
    plan = resolve({}, services(controller=None, actor=None, reward=None), CPU)
    assert plan.groups == {}
    for s in ("controller", "actor", "reward"):
        assert plan.cuda_visible_devices(s) == ""
    assert "RLFLEET_ACTOR_GPUS=none" in plan.env_lines()


def test_unknown_group_named_by_a_service_is_refused() -> None:
    with pytest.raises(PlacementError, match=r"services.actor.device_group: device group 'nope' not found"):
        resolve(groups(a={"count": 1}), services(actor="nope"), ONE)


def test_unused_groups_are_not_placed() -> None:
    plan = resolve(groups(a={"count": 1}, spare={"ids": [7]}), services(actor="a"), TWO)
    assert list(plan.groups) == ["a"]
    assert plan.unused_groups == ("spare",)


# --- output ---------------------------------------------------------------------------------------


def test_env_file_and_table() -> None:
    plan = resolve(groups(actor_group={"ids": [0, 1]}, scorers={"count": 1, "min_memory_gb": 40}),
                   services(controller=None, actor="actor_group", reward="scorers", reference="scorers"), FOUR)
    env = dict(line.split("=", 1) for line in plan.env_lines() if line and not line.startswith("#"))
    assert env["RLFLEET_ACTOR_GPUS"] == "0,1"
    assert env["RLFLEET_ACTOR_GPU_COUNT"] == "2"
    assert env["RLFLEET_ACTOR_CUDA_VISIBLE_DEVICES"] == "GPU-0000,GPU-0001"
    assert env["RLFLEET_REWARD_GPUS"] == env["RLFLEET_REFERENCE_GPUS"] == "2"
    assert env["RLFLEET_CONTROLLER_GPUS"] == "none"
    assert env["RLFLEET_CONTROLLER_CUDA_VISIBLE_DEVICES"] == ""
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    table = plan.table()
    assert "actor_group" in table and "0,1" in table and "H100, L40S" in table
    assert "reward, reference" in table
    assert "(none: CPU)" in table and "controller" in table
    d = json.loads(plan.to_json())
    assert d["services"]["actor"]["gpus"] == "0,1"
    assert d["groups"]["scorers"]["gpus"] == [2]


def test_indices_without_uuids_fall_back_to_numbers() -> None:
    inv = Inventory.synthetic([{"index": 0, "memory_gb": 16, "arch": "sm75"}, {"index": 1, "memory_gb": 16}])
    plan = resolve(groups(g={"count": 2}), services(actor="g"), inv)
    assert plan.cuda_visible_devices("actor") == "0,1"
    assert plan.service_env("actor") == {"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert inv.gpus[0].arch == "turing" and inv.gpus[0].sm == "sm75"


# --- inventory sources ------------------------------------------------------------------------------


def test_arch_family_table() -> None:
    assert arch_family(9, 0) == "hopper"
    assert arch_family(8, 9) == "ada"
    assert arch_family(8, 6) == "ampere"
    assert arch_family(10, 0) == "blackwell"
    assert arch_family(12, 0) == "blackwell"
    assert arch_family(7, 5) == "turing"
    assert arch_family(8, 8) == "ampere"  # unknown minor: the closest below


class _FakeNvml:
    def __init__(self, devices: list[tuple[str, int, tuple[int, int]]], fail_init: bool = False) -> None:
        self.devices, self.fail_init, self.shutdown = devices, fail_init, False

    def nvmlInit(self) -> None:  # noqa: N802
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:  # noqa: N802
        return self.devices[h][0].encode()

    def nvmlDeviceGetUUID(self, h: int) -> str:  # noqa: N802
        return f"GPU-fake-{h}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(total=self.devices[h][1] * 2**30, used=0, free=0)

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:  # noqa: N802
        return self.devices[h][2]


def test_discover_gpus_reads_nvml() -> None:
    fake = _FakeNvml([("NVIDIA H200", 141, (9, 0)), ("NVIDIA L4", 24, (8, 9))])
    inv = discover_gpus(fake)
    assert [(g.index, g.name, g.memory_gb, g.arch, g.sm, g.uuid) for g in inv.gpus] == [
        (0, "NVIDIA H200", 141.0, "hopper", "sm90", "GPU-fake-0"),
        (1, "NVIDIA L4", 24.0, "ada", "sm89", "GPU-fake-1"),
    ]
    assert fake.shutdown and inv.reason is None


def test_discover_gpus_without_a_driver_is_empty_with_a_reason() -> None:
    inv = discover_gpus(_FakeNvml([], fail_init=True))
    assert inv.gpus == () and "NVML unavailable" in (inv.reason or "")
    assert discover_gpus(_FakeNvml([])).reason == "NVML reports no GPU"
    real = discover_gpus()  # this machine: whatever it has, never raises
    assert real.gpus or real.reason


def test_inventory_file_round_trips_and_validates(tmp_path: Path) -> None:
    f = tmp_path / "inv.yaml"
    f.write_text(yaml.safe_dump({"gpus": [{"index": 0, "name": "H100", "memory_gb": 80, "arch": "hopper"},
                                          {"index": 1, "name": "A10", "memory_gb": 24, "compute_capability": "8.6"}]}))
    inv = load_inventory(f)
    assert [g.arch for g in inv.gpus] == ["hopper", "ampere"]
    # What `rlfleet plan --json` prints under "inventory" loads back.
    f2 = tmp_path / "inv.json"
    f2.write_text(json.dumps(inv.to_dict()))
    assert load_inventory(f2).gpus == inv.gpus
    f.write_text(yaml.safe_dump({"gpus": [{"index": 0, "memory": 80}]}))
    with pytest.raises(PlacementError, match=r"gpus\[0\]: unknown keys \['memory'\]"):
        load_inventory(f)


# --- rlfleet plan ---------------------------------------------------------------------------------


def _write_config(tmp_path: Path, **sections: Any) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    data.update(sections)
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _inventory_file(tmp_path: Path, inv: Inventory) -> Path:
    p = tmp_path / "inventory.json"
    p.write_text(json.dumps(inv.to_dict()))
    return p


def test_plan_command_writes_the_compose_env_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write_config(tmp_path, algo={"name": "ppo", "kl_coef": 0.05, "group_size": 2},
                        devices={"actor_group": {"count": 1, "prefer_arch": "hopper"}, "critic_group": {"count": 1}},
                        services={"actor": {"device_group": "actor_group"}, "critic": {"device_group": "critic_group"}})
    out = tmp_path / "plan.env"
    assert plan_main(cfg, out, False, _inventory_file(tmp_path, FOUR)) == 0
    printed = capsys.readouterr().out
    assert "actor_group" in printed and "critic_group" in printed
    env = dict(line.split("=", 1) for line in out.read_text().splitlines() if line and not line.startswith("#"))
    assert env["RLFLEET_ACTOR_GPUS"] == "1"  # the hopper, preferred
    assert env["RLFLEET_CRITIC_GPUS"] == "0"
    assert env["RLFLEET_REWARD_GPUS"] == "none"
    assert env["COMPOSE_PROFILES"] == "reference,critic"
    assert Path(env["RLFLEET_CONFIG"]) == cfg.resolve()


def test_plan_command_refuses_gpu_groups_on_a_cpu_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write_config(tmp_path, devices={"actor_group": {"count": 1}},
                        services={"actor": {"device_group": "actor_group"}})
    empty = tmp_path / "none.yaml"
    empty.write_text("gpus: []\n")
    assert plan_main(cfg, tmp_path / "plan.env", False, empty) == 1
    assert "device groups 'actor_group' (actor) need GPUs but this host has none" in capsys.readouterr().err
    assert not (tmp_path / "plan.env").exists()


def test_plan_command_on_the_tiny_default_and_the_examples(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "none.yaml"
    empty.write_text("gpus: []\n")
    assert plan_main(ROOT / "examples" / "tiny-cpu.yaml", None, True, empty) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["services"]["actor"]["gpus"] == ""
    assert d["compose_profiles"] == ["reference"]  # grpo with kl: no critic
    two = _inventory_file(tmp_path, gpus((80, "hopper"), (80, "hopper")))
    for name in ("one-gpu.yaml", "two-gpu.yaml"):
        load_config(ROOT / "examples" / name)  # valid configs
        assert plan_main(ROOT / "examples" / name, tmp_path / f"{name}.env", False, two) == 0, name
    assert plan_main(ROOT / "examples" / "two-gpu.yaml", None, False,
                     _inventory_file(tmp_path, ONE)) == 1  # two groups do not fit on one GPU


def test_plan_command_reports_bad_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("algo: {name: dpo}\n")
    assert plan_main(p, None, False, None) == 2
    assert "algo.name" in capsys.readouterr().err
    # parse_config sanity: a config with no devices section plans on any host.
    assert parse_config({}).devices == {}


# --- rlfleet up -----------------------------------------------------------------------------------

def _decoupled(tmp_path: Path) -> Any:
    return parse_config({
        "run": {"dir": str(tmp_path / "run")},
        "algo": {"name": "ppo", "kl_coef": 0.05},
        "devices": {"actor_gpu": {"ids": [0]}, "scorer_gpu": {"ids": [1]}},
        "services": {"actor": {"device_group": "actor_gpu", "device": "cuda"},
                     "critic": {"device_group": "scorer_gpu", "device": "cuda"},
                     "reference": {"device_group": "scorer_gpu", "device": "cuda"}},
    })


def test_fleet_pins_each_service_to_its_groups_gpus(tmp_path: Path) -> None:
    from services.fleet import Fleet

    fleet = Fleet(_decoupled(tmp_path), inventory=TWO)
    fleet.plan = fleet.place(fleet.base_cfg)
    env = {n: fleet.service_env(n) for n in ("actor", "critic", "reference", "reward", "controller")}
    assert env["actor"]["CUDA_VISIBLE_DEVICES"] == "GPU-0000"
    assert env["critic"]["CUDA_VISIBLE_DEVICES"] == env["reference"]["CUDA_VISIBLE_DEVICES"] == "GPU-0001"
    # Services without a device group see no GPU.
    assert env["reward"]["CUDA_VISIBLE_DEVICES"] == env["controller"]["CUDA_VISIBLE_DEVICES"] == ""
    assert all(e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for e in env.values())


def test_fleet_refuses_a_placement_the_host_cannot_hold_before_starting_anything(tmp_path: Path) -> None:
    from services.fleet import Fleet, FleetError

    fleet = Fleet(_decoupled(tmp_path), inventory=ONE)
    with pytest.raises(FleetError, match=r"device groups cannot be placed.*scorer_gpu"):
        fleet.prepare()
    assert fleet.redis is None and not (tmp_path / "run").exists()


def test_fleet_without_gpus_runs_unpinned(tmp_path: Path) -> None:
    from services.fleet import Fleet

    fleet = Fleet(_decoupled(tmp_path), inventory=CPU)
    assert fleet.place(fleet.base_cfg) is None
    assert fleet.service_env("actor").get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")

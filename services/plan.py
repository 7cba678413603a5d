"""`rlfleet plan`: resolve a run config's device groups against this host's GPUs.

    rlfleet plan --config CONFIG [--inventory FILE] [--out ENV_FILE] [--json]

prints which GPUs each device group gets and which services run on them, and with `--out` writes
the env file docker compose reads (`docker compose --env-file ENV_FILE up`):

    RLFLEET_<SERVICE>_GPUS                  NVML indices for deploy.resources.reservations.devices
                                            ("none" for a service without a device group)
    RLFLEET_<SERVICE>_GPU_COUNT             how many
    RLFLEET_<SERVICE>_CUDA_VISIBLE_DEVICES  for running the service as a host process
    CUDA_DEVICE_ORDER=PCI_BUS_ID            so host processes number GPUs as NVML does
    COMPOSE_PROFILES                        the optional stages this algorithm runs (critic, reference)
    RLFLEET_CONFIG                          the run config (absolute path), mounted by compose

With `--k8s-patch FILE` it also writes a kustomize patch for deploy/k8s giving each Deployment's
container the GPU count of its device group (`nvidia.com/gpu: N`; a scorer with several replicas
on a group of several GPUs: one GPU per pod). The actor's group is shared inside the service by its
trainer ranks and its engine replicas (`generation.replicas` x `tensor_parallel_size`); the plan
prints how.

GPUs come from NVML on this host, or from `--inventory FILE` (YAML/JSON; the `inventory` object of
`--json` output is one) to plan for another host. Exit status: 0 planned, 1 placement refused
(the message names the device group and the field), 2 invalid config or inventory.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from services.core.config.run import SERVICE_NAMES, ConfigError, RunConfig, load_config
from services.core.host.placement import Inventory, PlacementError, Plan, discover_gpus, load_inventory, resolve

OPTIONAL_STAGES = ("reference", "critic")


def compose_profiles(cfg: RunConfig) -> list[str]:
    """docker-compose.yml profiles of the optional stages this config runs."""
    needed = set(cfg.services_needed())
    return [s for s in OPTIONAL_STAGES if s in needed]


def make_plan(cfg: RunConfig, inventory: Inventory) -> Plan:
    """Place the device groups of the services this config starts (a stage the algorithm does not
    need is not started, so its group takes no GPU)."""
    plan = resolve(cfg.devices, {n: cfg.endpoint(n) for n in cfg.services_needed()}, inventory)
    return replace(plan, notes=plan.notes + tuple(group_use_notes(cfg, plan)))


def trainer_ranks(cfg: RunConfig, service: str, gpus: int) -> int:
    """Trainer ranks of the actor or critic: the service's `trainer_ranks` field where the config has
    one (multi-rank trainers), else one rank per GPU of its group (one on the CPU)."""
    field = getattr(cfg.endpoint(service), "trainer_ranks", None)  # type: ignore[arg-type]
    return int(field) if isinstance(field, int) and field > 0 else max(gpus, 1)


def group_use_notes(cfg: RunConfig, plan: Plan) -> list[str]:
    """How the actor (and critic) split their group: trainer ranks, engine replicas and their GPUs."""
    from services.models.engines.replicas import replica_layout

    notes = []
    for svc in ("actor", "critic"):
        if svc not in plan.service_groups or not plan.gpu_count(svc):
            continue
        gpus = plan.gpus_for(svc)
        ranks = trainer_ranks(cfg, svc, len(gpus))
        if ranks > len(gpus) and cfg.endpoint(svc).device.startswith("cuda"):  # type: ignore[arg-type]
            # Rank r trains on cuda:r of the group: more ranks than GPUs would fail at start-up.
            raise PlacementError(f"services.{svc}.trainer_ranks: {ranks} ranks on a device group of {len(gpus)}"
                                 f" GPU(s) ({plan.gpu_ids(svc)}); give the group {ranks} GPUs or train on fewer ranks")
        line = f"{svc}: {ranks} trainer rank(s) on GPUs {plan.gpu_ids(svc)}"
        g = cfg.generation
        if svc == "actor" and (g.replicas > 1 or g.tensor_parallel_size > 1):
            layout = replica_layout(g.replicas, g.tensor_parallel_size, [str(x.index) for x in gpus])
            where = "; ".join(f"replica {r} on GPU {','.join(layout.devices[r])}" for r in range(layout.replicas))
            line += f"; {g.replicas} engine replica(s) x tensor_parallel_size {g.tensor_parallel_size}: {where}"
            if layout.memory_share < 1:
                line += f" (sharing: each takes {layout.memory_share:.2g} of generation.vllm.gpu_memory_utilization)"
        notes.append(line)
    return notes


def k8s_patch_text(plan: Plan) -> str:
    """Strategic-merge patches for deploy/k8s (kustomize `patches:`): each GPU service's container
    requests and is limited to its GPU count."""
    docs: list[dict[str, Any]] = []
    for svc in sorted(plan.service_groups):
        n = plan.per_replica_gpu_count(svc)
        if not n:
            continue
        gpu = {"nvidia.com/gpu": n}
        docs.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": svc, "namespace": "rlfleet"},
                     "spec": {"template": {"spec": {"containers": [
                         {"name": svc, "resources": {"requests": dict(gpu), "limits": dict(gpu)}}]}}}})
    head = "# written by `rlfleet plan --k8s-patch`: GPUs per pod from the plan's device groups\n"
    return head + yaml.safe_dump_all(docs, sort_keys=False)


def env_file_text(cfg: RunConfig, plan: Plan, config_path: Path) -> str:
    header = f"written by `rlfleet plan --config {config_path}` on {socket.gethostname()} at " \
             f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}"
    lines = plan.env_lines(header)
    for svc in SERVICE_NAMES:
        if svc not in plan.service_groups:
            key = svc.upper()
            lines += [f"# {svc}: not started by this config ({cfg.algo.name}, kl_coef {cfg.algo.kl_coef:g})",
                      f"RLFLEET_{key}_GPUS=none", f"RLFLEET_{key}_GPU_COUNT=0", f"RLFLEET_{key}_CUDA_VISIBLE_DEVICES="]
    lines += ["# optional stages docker compose starts for this algorithm",
              f"COMPOSE_PROFILES={','.join(compose_profiles(cfg))}",
              f"RLFLEET_CONFIG={config_path.resolve()}"]
    return "\n".join(lines) + "\n"


def plan_main(config: Path, out: Path | None, json_out: bool, inventory: Path | None,
              k8s_patch: Path | None = None) -> int:
    try:
        cfg = load_config(config)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    try:
        inv = load_inventory(inventory) if inventory is not None else discover_gpus()
    except PlacementError as err:
        print(f"rlfleet plan: {err}", file=sys.stderr)
        return 2
    try:
        plan = make_plan(cfg, inv)
    except PlacementError as err:
        print(f"rlfleet plan: {err}", file=sys.stderr)
        return 1
    if json_out:
        d = plan.to_dict()
        d["config"] = str(Path(config).resolve())
        d["services_needed"] = list(cfg.services_needed())
        d["compose_profiles"] = compose_profiles(cfg)
        print(json.dumps(d, indent=2))
    else:
        print(plan.table())
        skipped = [s for s in SERVICE_NAMES if s not in plan.service_groups]
        if skipped:
            print(f"not started by this config: {', '.join(skipped)}")
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(env_file_text(cfg, plan, Path(config)))
        tmp.replace(out)
        if not json_out:
            print(f"wrote {out} (docker compose --env-file {out} ...)")
    if k8s_patch is not None:
        k8s_patch = Path(k8s_patch)
        k8s_patch.parent.mkdir(parents=True, exist_ok=True)
        k8s_patch.write_text(k8s_patch_text(plan))
        if not json_out:
            print(f"wrote {k8s_patch} (add it to deploy/k8s/kustomization.yaml patches)")
    return 0

"""Placement: resolve the config's device groups against the GPUs of a host.

A run config names device groups (``devices:``) and each service names its group
(``services.<name>.device_group``). A group is either explicit (``ids: [0, 1]``) or a request
(``count: 2`` with hard constraints ``min_memory_gb`` / ``arch`` and a soft wish ``prefer_arch``).
`resolve` turns groups + services + an `Inventory` into a `Plan`: which GPUs each group gets and
therefore which GPUs each service sees. It refuses, with the group and the field named:

* explicit ids that the host does not have, or that fail the group's own constraints;
* two groups that would share a GPU (groups are disjoint; services that should share GPUs name
  the same group);
* a request that cannot be met by the GPUs left after the other groups.

Requests are assigned all at once (a minimum-cost matching of group slots to GPUs), so a group that
could be satisfied is never starved by the order groups are written in. Among the assignments that
satisfy every hard constraint the plan picks the one that honours the most ``prefer_arch`` wishes,
then keeps each group on the lowest, contiguous GPU indices in the order the groups are declared.

The GPUs themselves (NVML discovery, inventory files, GPU numbering) are in `services.core.host.inventory`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.core.config.run import DeviceGroup, Endpoint
from services.core.host.inventory import Gpu, Inventory, PlacementError, arch_family, discover_gpus, load_inventory

__all__ = [
    "Gpu",
    "Inventory",
    "PlacementError",
    "Plan",
    "arch_family",
    "discover_gpus",
    "load_inventory",
    "resolve",
]


# --- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupPlacement:
    name: str
    gpus: tuple[Gpu, ...]
    services: tuple[str, ...]
    preferred_met: bool | None = None  # None: the group has no prefer_arch

    @property
    def ids(self) -> list[int]:
        return [g.index for g in self.gpus]


@dataclass(frozen=True)
class Plan:
    groups: dict[str, GroupPlacement]
    service_groups: dict[str, str | None]  # service -> group (None: no GPU)
    service_replicas: dict[str, int]
    inventory: Inventory
    unused_groups: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    # -- per service -------------------------------------------------------------------------------
    def gpus_for(self, service: str) -> tuple[Gpu, ...]:
        group = self.service_groups.get(service)
        return self.groups[group].gpus if group else ()

    def gpu_ids(self, service: str) -> str:
        """NVML indices, comma separated ("" for no GPU): docker's device_ids."""
        return ",".join(str(g.index) for g in self.gpus_for(service))

    def cuda_visible_devices(self, service: str) -> str:
        """For a process on the host: UUIDs when every GPU has one, else NVML indices (then
        CUDA_DEVICE_ORDER=PCI_BUS_ID must be set too, which `service_env` does). "" hides every GPU."""
        gpus = self.gpus_for(service)
        if gpus and all(g.uuid for g in gpus):
            return ",".join(g.uuid for g in gpus)
        return ",".join(str(g.index) for g in gpus)

    def gpu_count(self, service: str) -> int:
        return len(self.gpus_for(service))

    def replica_gpus(self, service: str, replica: int) -> tuple[Gpu, ...]:
        """The GPUs replica `replica` of a scorer sees: with several replicas on a group of several GPUs,
        one GPU each (round-robin when there are more replicas than GPUs); otherwise the whole group.
        The actor and critic are one service process on all of their group's GPUs (their trainer ranks
        and engine replicas split the group inside the service)."""
        gpus = self.gpus_for(service)
        if self.service_replicas.get(service, 1) > 1 and len(gpus) > 1:
            return (gpus[replica % len(gpus)],)
        return gpus

    def per_replica_gpu_count(self, service: str) -> int:
        """GPUs one process (one pod) of `service` needs: Kubernetes' nvidia.com/gpu."""
        return len(self.replica_gpus(service, 0))

    def service_env(self, service: str, replica: int = 0) -> dict[str, str]:
        """Environment for running `service` (its replica `replica`) as a host process (what `rlfleet up`
        merges in): CUDA_VISIBLE_DEVICES lists every GPU the process may use."""
        gpus = self.replica_gpus(service, replica)
        if gpus and all(g.uuid for g in gpus):
            visible = ",".join(g.uuid for g in gpus)
        else:
            visible = ",".join(str(g.index) for g in gpus)
        return {"CUDA_VISIBLE_DEVICES": visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    # -- output --------------------------------------------------------------------------------------
    def env_lines(self, header: str | None = None) -> list[str]:
        """A docker-compose env file: RLFLEET_<SERVICE>_GPUS (NVML indices for docker's device_ids;
        "none" for a service without a group, which the NVIDIA container runtime reads as no GPU),
        RLFLEET_<SERVICE>_GPU_COUNT and RLFLEET_<SERVICE>_CUDA_VISIBLE_DEVICES (for host processes;
        "" hides every GPU)."""
        lines = [f"# {header}"] if header else []
        lines.append("# rlfleet plan: GPU placement per service. Services without a device group get no GPU.")
        lines.append("CUDA_DEVICE_ORDER=PCI_BUS_ID")
        for svc in sorted(self.service_groups):
            key = svc.upper()
            group = self.service_groups[svc]
            lines.append(f"# {svc}: " + (f"group '{group}'" if group else "no device group (CPU)"))
            lines.append(f"RLFLEET_{key}_GPUS={self.gpu_ids(svc) or 'none'}")
            lines.append(f"RLFLEET_{key}_GPU_COUNT={len(self.gpus_for(svc))}")
            lines.append(f"RLFLEET_{key}_CUDA_VISIBLE_DEVICES={self.cuda_visible_devices(svc)}")
        return lines

    def table(self) -> str:
        """group -> GPU ids / names / memory -> services, then one row per service."""
        rows: list[tuple[str, str, str, str, str]] = []
        for name, gp in self.groups.items():
            names = ", ".join(sorted({g.name for g in gp.gpus}))
            mem = " + ".join(f"{g.memory_gb:g}" for g in gp.gpus) + " GB"
            svcs = ", ".join(f"{s} x{self.service_replicas[s]}" if self.service_replicas.get(s, 1) > 1 else s
                             for s in gp.services)
            rows.append((name, ",".join(str(i) for i in gp.ids), names, mem, svcs))
        cpu = [s for s, g in self.service_groups.items() if g is None]
        if cpu:
            rows.append(("(none: CPU)", "-", "-", "-", ", ".join(cpu)))
        head = ("group", "gpus", "model", "memory", "services")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        out = [f"GPU inventory ({self.inventory.source}): "
               + (", ".join(g.describe() for g in self.inventory.gpus) or f"none ({self.inventory.reason})"),
               fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        out[1:3] = [line.rstrip() for line in out[1:3]]
        out += [fmt.format(*r).rstrip() for r in rows]
        out.append("")
        for svc in sorted(self.service_groups):
            out.append(f"{svc:<10} CUDA_VISIBLE_DEVICES={self.cuda_visible_devices(svc)!r}")
        for g in self.unused_groups:
            out.append(f"note: device group '{g}' is not used by any service that runs; not placed")
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "inventory": self.inventory.to_dict(),
            "groups": {n: {"gpus": gp.ids, "services": list(gp.services), "preferred_met": gp.preferred_met,
                           "names": [g.name for g in gp.gpus], "memory_gb": [g.memory_gb for g in gp.gpus]}
                       for n, gp in self.groups.items()},
            "services": {s: {"group": g, "gpus": self.gpu_ids(s),
                             "cuda_visible_devices": self.cuda_visible_devices(s),
                             "replicas": self.service_replicas.get(s, 1)}
                         for s, g in sorted(self.service_groups.items())},
            "unused_groups": list(self.unused_groups),
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# --- resolution -----------------------------------------------------------------------------------


def _constraints(g: DeviceGroup) -> str:
    parts = []
    if g.min_memory_gb:
        parts.append(f"min_memory_gb >= {g.min_memory_gb:g}")
    if g.arch:
        parts.append(f"arch '{g.arch}'")
    return " and ".join(parts)


def _fits(gpu: Gpu, g: DeviceGroup) -> bool:
    return gpu.memory_gb >= g.min_memory_gb and (not g.arch or gpu.matches_arch(g.arch))


def _ids_text(ids: Iterable[int]) -> str:
    return ",".join(str(i) for i in ids) or "none"


# Costs of the matching: a missed prefer_arch wish outweighs any index order.
_MISS_PREFERENCE = 1_000_000


def _min_cost_assignment(slots: list[str], eligible: dict[str, set[int]],
                         cost: dict[tuple[str, int], int]) -> dict[int, int] | None:
    """Give every slot (one per GPU a group needs, named by its group) a distinct eligible GPU at
    minimum total cost. Returns slot position -> GPU index, or None when no full assignment exists.

    Successive shortest augmenting paths, Bellman-Ford on the residual graph (matched edges run
    backwards at negative cost). Tens of slots and GPUs at most: simple beats fast here."""
    inf = float("inf")
    slot_gpu: dict[int, int] = {}
    gpu_slot: dict[int, int] = {}
    for s in range(len(slots)):
        dist_slot: dict[int, float] = {s: 0.0}
        dist_gpu: dict[int, float] = {}
        via: dict[int, int] = {}  # gpu -> the slot its shortest path came from
        for _ in range(2 * (len(slots) + len(cost)) + 2):
            changed = False
            for slot, d in list(dist_slot.items()):
                for gi in sorted(eligible[slots[slot]]):
                    if slot_gpu.get(slot) == gi:
                        continue
                    nd = d + cost[(slots[slot], gi)]
                    if nd < dist_gpu.get(gi, inf):
                        dist_gpu[gi], via[gi], changed = nd, slot, True
            for gi, d in list(dist_gpu.items()):
                o = gpu_slot.get(gi)
                if o is not None:
                    nd = d - cost[(slots[o], gi)]
                    if nd < dist_slot.get(o, inf):
                        dist_slot[o], changed = nd, True
            if not changed:
                break
        free = [gi for gi in dist_gpu if gi not in gpu_slot]
        if not free:
            return None
        gi = min(free, key=lambda g: (dist_gpu[g], g))
        while True:  # flip the alternating path back to s
            slot = via[gi]
            previous = slot_gpu.get(slot)
            slot_gpu[slot], gpu_slot[gi] = gi, slot
            if slot == s:
                break
            assert previous is not None
            gi = previous
    return slot_gpu


def resolve(devices: Mapping[str, DeviceGroup], services: Mapping[str, Endpoint], inventory: Inventory) -> Plan:
    """Place every device group used by `services` on `inventory`'s GPUs. Raises PlacementError."""
    service_groups: dict[str, str | None] = {s: ep.device_group for s, ep in services.items()}
    replicas = {s: ep.replicas for s, ep in services.items()}
    for svc, grp in service_groups.items():
        if grp is not None and grp not in devices:
            known = ", ".join(sorted(devices)) or "none defined"
            raise PlacementError(f"services.{svc}.device_group: device group '{grp}' not found in devices"
                                 f" (known: {known})")
    used = [g for g in devices if g in set(service_groups.values())]
    unused = tuple(g for g in devices if g not in used)
    users = {g: tuple(s for s, sg in service_groups.items() if sg == g) for g in used}
    if used and not inventory.gpus:
        needs = ", ".join(f"'{g}' ({', '.join(users[g])})" for g in used)
        raise PlacementError(
            f"device groups {needs} need GPUs but this host has none: {inventory.reason or 'empty inventory'}."
            " Run `rlfleet plan` on the GPU host, pass --inventory FILE, or remove the services' device_group"
            " for a CPU run")

    by_index = inventory.by_index()
    found = inventory.indices_text()
    taken: dict[int, str] = {}
    placed: dict[str, tuple[Gpu, ...]] = {}

    # 1. Explicit ids: present, meeting the group's own constraints, and disjoint.
    for name in used:
        g = devices[name]
        if g.ids is None:
            continue
        missing = [i for i in g.ids if i not in by_index]
        if missing:
            raise PlacementError(f"device group '{name}': ids {missing} not present (found {found})")
        for i in g.ids:
            gpu = by_index[i]
            if gpu.memory_gb < g.min_memory_gb:
                raise PlacementError(f"device group '{name}': ids: GPU {i} ({gpu.name}) has {gpu.memory_gb:g} GB,"
                                     f" below min_memory_gb {g.min_memory_gb:g}")
            if g.arch and not gpu.matches_arch(g.arch):
                raise PlacementError(f"device group '{name}': ids: GPU {i} ({gpu.name}) is {gpu.arch or 'unknown'}"
                                     f"{'/' + gpu.sm if gpu.sm else ''}, not arch '{g.arch}'")
            if i in taken:
                raise PlacementError(f"device groups '{taken[i]}' and '{name}' overlap: both claim GPU {i} (ids);"
                                     " groups must be disjoint; let services share one group instead")
            taken[i] = name
        placed[name] = tuple(by_index[i] for i in g.ids)

    # 2. Requests: each on its own first (a clear message), then all together.
    requests = [n for n in used if devices[n].count is not None]
    pool = [gpu for gpu in inventory.gpus if gpu.index not in taken]
    eligible: dict[str, set[int]] = {}
    for name in requests:
        g = devices[name]
        count = g.count or 0
        fits_host = [gpu for gpu in inventory.gpus if _fits(gpu, g)]
        eligible[name] = {gpu.index for gpu in pool if _fits(gpu, g)}
        if len(eligible[name]) < count:
            what = f"count {count} needs {count} GPU{'s' if count != 1 else ''}"
            cons = _constraints(g)
            if cons:
                what += f" with {cons}"
            if len(fits_host) < count:
                raise PlacementError(f"device group '{name}': {what}; this host has {len(fits_host)}"
                                     f" (found {', '.join(x.describe() for x in inventory.gpus)})")
            raise PlacementError(f"device group '{name}': {what}; {len(eligible[name])} left after other groups"
                                 f" ({', '.join(f'{o}: {_ids_text(x.index for x in v)}' for o, v in placed.items())})")
    total = sum(devices[n].count or 0 for n in requests)
    if total > len(pool):
        raise PlacementError(f"device groups {', '.join(repr(n) for n in requests)}: count adds up to {total} GPUs;"
                             f" {len(pool)} left after explicit ids (found {found})")

    weight = {name: len(requests) - k for k, name in enumerate(requests)}  # earlier groups: lower ids
    cost: dict[tuple[str, int], int] = {}
    for name in requests:
        g = devices[name]
        for gpu in pool:
            miss = bool(g.prefer_arch) and not gpu.matches_arch(g.prefer_arch or "")
            cost[(name, gpu.index)] = _MISS_PREFERENCE * miss + weight[name] * gpu.index
    slots: list[str] = []
    previous: dict[int, int] = {}
    for name in requests:
        slots.extend([name] * (devices[name].count or 0))
        got = _min_cost_assignment(slots, eligible, cost)
        if got is None:
            g = devices[name]
            cons = _constraints(g)
            taken_by = {o: sorted(gi for pos, gi in previous.items() if slots[pos] == o)
                        for o in requests[: requests.index(name)]}
            left = len(eligible[name] - set(previous.values()))
            others = [f"{o}: {_ids_text(x.index for x in pinned)}" for o, pinned in placed.items()]
            others += [f"{o}: {_ids_text(ids)}" for o, ids in taken_by.items()]
            raise PlacementError(
                f"device group '{name}': count {g.count} needs {g.count} GPU{'s' if g.count != 1 else ''}"
                f"{' with ' + cons if cons else ''}; {left} left after other groups ({', '.join(others)})")
        previous = got
    assignment = _min_cost_assignment(slots, eligible, cost) if slots else {}
    assert assignment is not None
    for name in requests:
        ids = sorted(gi for pos, gi in assignment.items() if slots[pos] == name)
        placed[name] = tuple(by_index[i] for i in ids)

    groups: dict[str, GroupPlacement] = {}
    notes: list[str] = []
    for name in used:
        g = devices[name]
        gpus = placed[name]
        met = None
        if g.prefer_arch:
            met = all(x.matches_arch(g.prefer_arch) for x in gpus)
            if not met:
                notes.append(f"device group '{name}': prefer_arch '{g.prefer_arch}' not met on every GPU"
                             f" (got {', '.join(x.describe() for x in gpus)})")
        groups[name] = GroupPlacement(name, gpus, users[name], met)
        for svc in users[name]:
            if replicas.get(svc, 1) > 1 and len(gpus) > 1:
                each = ", ".join(f"{r}: GPU {gpus[r % len(gpus)].index}" for r in range(replicas[svc]))
                notes.append(f"{svc}: {replicas[svc]} replicas on group '{name}', one GPU each (replica {each})")
            elif replicas.get(svc, 1) > 1:
                notes.append(f"{svc}: {replicas[svc]} replicas share group '{name}'"
                             f" (GPUs {_ids_text(x.index for x in gpus)})")
    return Plan(groups, service_groups, replicas, inventory, unused, tuple(notes))

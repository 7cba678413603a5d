"""The GPUs of a host: what NVML reports, or what an inventory file describes.

This module is pure: NVML is imported only inside `discover_gpus`, so planning works on any machine
(`rlfleet plan --inventory FILE` plans for a host described in a file).

GPU numbering: `Gpu.index` is the NVML index (PCI bus order), which is what the NVIDIA container
runtime takes as ``device_ids``. CUDA numbers devices fastest-first unless ``CUDA_DEVICE_ORDER`` is
``PCI_BUS_ID``, so the CUDA_VISIBLE_DEVICES a plan writes are GPU UUIDs when known (stable under
any ordering), with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` alongside.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Gpu", "Inventory", "PlacementError", "arch_family", "discover_gpus", "load_inventory"]

# Compute capability (major, minor) -> architecture family, as NVIDIA names them.
_FAMILIES: tuple[tuple[tuple[int, int], str], ...] = (
    ((3, 0), "kepler"),
    ((5, 0), "maxwell"),
    ((6, 0), "pascal"),
    ((7, 0), "volta"),
    ((7, 2), "volta"),
    ((7, 5), "turing"),
    ((8, 0), "ampere"),
    ((8, 6), "ampere"),
    ((8, 7), "ampere"),
    ((8, 9), "ada"),
    ((9, 0), "hopper"),
    ((10, 0), "blackwell"),
    ((10, 3), "blackwell"),
    ((11, 0), "blackwell"),
    ((12, 0), "blackwell"),
    ((12, 1), "blackwell"),
)


def arch_family(major: int, minor: int) -> str:
    """The architecture family of a compute capability ("hopper" for 9.0); the closest known
    capability at or below it for one this table does not list."""
    best = "unknown"
    for (ma, mi), name in _FAMILIES:
        if (ma, mi) <= (major, minor) and (ma == major or best == "unknown" or ma < major):
            best = name
    return best


class PlacementError(ValueError):
    """A placement that cannot be made; the message names the device group and the field."""


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML index (PCI bus order), as `nvidia-smi` prints it
    name: str = "GPU"
    memory_gb: float = 0.0  # total memory, GiB
    uuid: str = ""
    compute_capability: str = ""  # "9.0"
    arch: str = ""  # "hopper"

    @property
    def sm(self) -> str:
        """"sm90" for compute capability 9.0, "" when unknown."""
        return "sm" + self.compute_capability.replace(".", "") if self.compute_capability else ""

    def matches_arch(self, wanted: str) -> bool:
        """True if `wanted` names this GPU's family ("hopper"), its SM ("sm90", "sm_90") or its
        compute capability ("9.0"). Case-insensitive."""
        w = wanted.strip().lower().replace("_", "")
        if not w:
            return True
        return w in {self.arch.lower(), self.sm.lower(), self.compute_capability.lower()} - {""}

    def describe(self) -> str:
        arch = self.arch or "?"
        if self.sm:
            arch += f"/{self.sm}"
        return f"{self.index}:{self.name} {self.memory_gb:g}GB {arch}"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Gpu:
        """From an inventory file row; `arch` may be a family ("hopper") or an SM ("sm90")."""
        known = {"index", "name", "memory_gb", "uuid", "compute_capability", "arch"}
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown keys {sorted(extra)}; allowed: {sorted(known)}")
        if "index" not in d:
            raise ValueError("each GPU needs an 'index'")
        cc = str(d.get("compute_capability", "") or "")
        arch = str(d.get("arch", "") or "").lower()
        m = re.fullmatch(r"sm_?(\d+)(\d)", arch)
        if m and not cc:
            cc, arch = f"{int(m.group(1))}.{m.group(2)}", ""
        if cc and not arch:
            ma, _, mi = cc.partition(".")
            arch = arch_family(int(ma), int(mi or 0))
        return cls(
            index=int(d["index"]),
            name=str(d.get("name", "GPU")),
            memory_gb=float(d.get("memory_gb", 0.0)),
            uuid=str(d.get("uuid", "") or ""),
            compute_capability=cc,
            arch=arch,
        )


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[Gpu, ...] = ()
    source: str = "none"  # "nvml", "file:<path>", "synthetic"
    reason: str | None = None  # why the inventory is empty, when it is

    def __post_init__(self) -> None:
        idx = [g.index for g in self.gpus]
        if len(set(idx)) != len(idx):
            raise ValueError(f"GPU indices repeat in the inventory: {sorted(idx)}")
        object.__setattr__(self, "gpus", tuple(sorted(self.gpus, key=lambda g: g.index)))

    def __len__(self) -> int:
        return len(self.gpus)

    def by_index(self) -> dict[int, Gpu]:
        return {g.index: g for g in self.gpus}

    def indices_text(self) -> str:
        return ",".join(str(g.index) for g in self.gpus) or "none"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "reason": self.reason, "gpus": [asdict(g) for g in self.gpus]}

    @classmethod
    def synthetic(cls, rows: Iterable[Mapping[str, Any] | Gpu]) -> Inventory:
        gpus = [r if isinstance(r, Gpu) else Gpu.from_dict(r) for r in rows]
        return cls(tuple(gpus), source="synthetic", reason=None if gpus else "no GPUs listed")


def load_inventory(path: str | Path) -> Inventory:
    """An inventory from a YAML/JSON file: a list of GPUs, or ``{gpus: [...]}`` (what
    ``rlfleet plan --json`` prints under ``inventory``). Each GPU: index, name, memory_gb, and
    arch (family or SM) or compute_capability, optionally uuid."""
    import yaml

    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise PlacementError(f"inventory {p}: cannot read: {e}") from None
    rows = raw.get("gpus", []) if isinstance(raw, dict) else raw
    if rows is None:
        rows = []
    if not isinstance(rows, list):
        raise PlacementError(f"inventory {p}: expected a list of GPUs (or a mapping with 'gpus')")
    gpus = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise PlacementError(f"inventory {p}: gpus[{i}] must be a mapping")
        try:
            gpus.append(Gpu.from_dict(row))
        except (TypeError, ValueError) as e:
            raise PlacementError(f"inventory {p}: gpus[{i}]: {e}") from None
    try:
        return Inventory(tuple(gpus), source=f"file:{p}", reason=None if gpus else f"{p} lists no GPUs")
    except ValueError as e:
        raise PlacementError(f"inventory {p}: {e}") from None


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def discover_gpus(nvml: Any = None) -> Inventory:
    """The GPUs NVML sees on this host (all of them: CUDA_VISIBLE_DEVICES does not apply).

    Never raises: without nvidia-ml-py, a driver or a device the inventory is empty and `reason`
    says why. `nvml` is the pynvml module (tests pass a fake)."""
    if nvml is None:
        try:
            import pynvml

            nvml = pynvml
        except ImportError:
            return Inventory(source="nvml", reason="nvidia-ml-py is not installed: pip install 'rlfleet[gpu]'")
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, NoPermission...
        return Inventory(source="nvml", reason=f"NVML unavailable ({type(e).__name__}: {e}); no NVIDIA driver?")
    try:
        gpus = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            try:
                ma, mi = nvml.nvmlDeviceGetCudaComputeCapability(h)
                cc, arch = f"{int(ma)}.{int(mi)}", arch_family(int(ma), int(mi))
            except Exception:
                cc, arch = "", ""
            gpus.append(Gpu(
                index=i,
                name=_text(nvml.nvmlDeviceGetName(h)),
                memory_gb=round(int(mem.total) / 2**30, 1),
                uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                compute_capability=cc,
                arch=arch,
            ))
    except Exception as e:
        return Inventory(source="nvml", reason=f"NVML query failed ({type(e).__name__}: {e})")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return Inventory(tuple(gpus), source="nvml", reason=None if gpus else "NVML reports no GPU")

"""The on-disk layout of a service's checkpoints (see `checkpoint.py` for the protocol).

Names and formats, the errors, `meta.json`, the `latest` pointer, the version directories, the
leftovers of crashed saves and the writer lock: everything about where a checkpoint lives and how
its directory is read, but not what goes into it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from services.models.io.durable import fsync_dir

log = logging.getLogger(__name__)

FORMAT = 1
MODEL_FILE = "model.safetensors"
OPTIM_TENSORS_FILE = "optimizer.safetensors"
OPTIM_JSON_FILE = "optimizer.json"
META_FILE = "meta.json"
DCP_DIR = "dcp"
LATEST = "latest"
LOCK_FILE = ".lock"

SERVICE_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$")
# `:08d` pads; versions past 99,999,999 simply get more digits and still parse.
VERSION_DIR_RE = re.compile(r"^v(\d{8,})$")
# Names our own crashed saves and prunes leave behind (dot-prefixed, so never a version dir).
LEFTOVER_RE = re.compile(r"^\.(v\d+\.tmp-|latest\.tmp-|trash-)")


class CheckpointError(RuntimeError):
    """A checkpoint operation that cannot succeed as asked; the message names the path."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint on disk is damaged or incomplete (missing file, bad sha256, unreadable meta).

    `load_latest` answers this by falling back to an older checkpoint."""


class CheckpointDiskFull(CheckpointError):
    """The disk filled up during a save: nothing was acknowledged, the previous checkpoint stays
    `latest` and intact, and the half-written files are gone. Saving again once space returns works."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint that does not fit the modules it is loaded into (other architecture,
    other optimizer, no optimizer state). Not a disk problem, so `load_latest` does not fall back:
    every older checkpoint would mismatch the same way, or worse, silently load a different run."""


@dataclass(frozen=True)
class CheckpointMeta:
    service: str
    version: int
    step: int
    created_at: float
    path: Path
    # file name -> sha256 hex digest and size in bytes, for every file but meta.json itself.
    sha256: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    # "safetensors" (one rank: model.safetensors, optimizer.*) or "dcp" (a multi-rank trainer's
    # torch.distributed.checkpoint files under dcp/, model and optimizer; checkpoint_dcp.py).
    layout: str = "safetensors"
    ranks: int = 1

    @property
    def has_optimizer(self) -> bool:
        return OPTIM_TENSORS_FILE in self.sha256 or self.layout == "dcp"


def version_dir_name(version: int) -> str:
    return f"v{version:08d}"


def service_dir(root: Path, service: str) -> Path:
    if not SERVICE_RE.match(service):
        raise ValueError(f"service name must match {SERVICE_RE.pattern}, got {service!r}")
    return Path(root) / service


def parse_version_dir(name: str) -> int | None:
    m = VERSION_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def version_of(path: Path) -> int:
    v = parse_version_dir(path.name)
    assert v is not None
    return v


def version_dirs(sdir: Path) -> list[Path]:
    """Version directories of a service, newest first."""
    if not sdir.is_dir():
        return []
    dirs = [p for p in sdir.iterdir() if parse_version_dir(p.name) is not None and p.is_dir()]
    return sorted(dirs, key=version_of, reverse=True)


def read_pointer(sdir: Path) -> str | None:
    """The directory name `latest` holds; None when there is no `latest` (nothing acknowledged)."""
    f = sdir / LATEST
    try:
        text = f.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointCorrupt(f"{f} cannot be read: {err}") from err
    if parse_version_dir(text) is None:
        raise CheckpointCorrupt(f"{f} holds {text[:40]!r}, not a version directory name")
    return text


def acknowledged_version(sdir: Path) -> tuple[int | None, Path | None]:
    """(the version saves must not go below, the directory `latest` names)."""
    try:
        pointed = read_pointer(sdir)
    except CheckpointCorrupt as err:
        # `latest` is only ever replaced by rename, so this takes outside damage. Stay conservative:
        # no version below any existing directory.
        dirs = version_dirs(sdir)
        log.warning("%s; treating the newest directory as the floor for new versions", err)
        return (version_of(dirs[0]) if dirs else None), None
    if pointed is None:
        return None, None
    return parse_version_dir(pointed), sdir / pointed


def write_pointer(sdir: Path, name: str) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{LATEST}.tmp-", dir=sdir)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(f"{name}\n".encode("ascii"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, sdir / LATEST)
        fsync_dir(sdir)
    finally:
        if tmp.exists():
            tmp.unlink()


def discard(path: Path, sdir: Path) -> None:
    """Remove a directory so that it vanishes from its name at once: rename, then delete. A crash
    mid-delete leaves a dot-named leftover, never a half directory under a version name."""
    trash = sdir / f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}"
    os.rename(path, trash)
    fsync_dir(sdir)
    shutil.rmtree(trash, ignore_errors=True)


def remove_leftovers(sdir: Path) -> None:
    # Only under the service lock: a live save's temp dir must not be taken for a crashed one's.
    for p in sdir.iterdir():
        if LEFTOVER_RE.match(p.name):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()


@contextlib.contextmanager
def locked(sdir: Path) -> Iterator[None]:
    # flock dies with its process, so a writer killed mid-save never blocks its replacement.
    fd = os.open(sdir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_meta(path: Path, service: str | None) -> CheckpointMeta:
    f = path / META_FILE
    try:
        doc = json.loads(f.read_bytes())
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{f} is missing" if path.is_dir() else f"checkpoint {path} is missing") from None
    except (OSError, ValueError) as err:
        raise CheckpointCorrupt(f"{f} cannot be read: {err}") from err
    try:
        if doc["format"] != FORMAT:
            raise CheckpointCorrupt(f"{f} has format {doc['format']}, this code reads {FORMAT}")
        files = doc["files"]
        meta = CheckpointMeta(
            service=str(doc["service"]),
            version=int(doc["version"]),
            step=int(doc["step"]),
            created_at=float(doc["created_at"]),
            path=path,
            sha256={str(k): str(v["sha256"]) for k, v in files.items()},
            sizes={str(k): int(v["bytes"]) for k, v in files.items()},
            layout=str(doc.get("layout", "safetensors")),
            ranks=int(doc.get("ranks", 1)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointCorrupt(f"{f} is malformed: {type(err).__name__}: {err}") from err
    if meta.layout not in ("safetensors", "dcp"):
        raise CheckpointCorrupt(f"{f} has layout {meta.layout!r}; this code reads 'safetensors' and 'dcp'")
    if meta.layout == "safetensors" and MODEL_FILE not in meta.sha256:
        raise CheckpointCorrupt(f"{f} lists no {MODEL_FILE}")
    if meta.layout == "dcp" and f"{DCP_DIR}/.metadata" not in meta.sha256:
        raise CheckpointCorrupt(f"{f} lists no {DCP_DIR}/.metadata")
    if service is not None and meta.service != service:
        raise CheckpointCorrupt(f"{f} belongs to service {meta.service!r}, not {service!r}")
    dir_version = parse_version_dir(path.name)
    if dir_version is not None and dir_version != meta.version:
        raise CheckpointCorrupt(f"{f} says version {meta.version} but lives in {path.name}")
    return meta

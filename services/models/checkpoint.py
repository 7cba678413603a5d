"""Crash-safe checkpoints of a trainable service (actor: causal LM + AdamW; critic: ValueModel + AdamW).

Layout, one directory per service under a shared root:

    <root>/<service>/v00000007/model.safetensors       the module's state dict (tied weights stored once)
                              optimizer.safetensors   optimizer state tensors, `state.<param_index>.<name>`
                              optimizer.json          param_groups hyper-params, step counts, other scalars
                              meta.json               service, version, step, created_at, sha256 per file
    <root>/<service>/latest                           "v00000007": the acknowledged checkpoint

Protocol (DESIGN.md, "Durability"): everything is written into a temporary directory beside the
final one, every file and the directory are fsynced, the directory is renamed to its final name and
the parent fsynced; only then is `latest` replaced (temp file, fsync, rename, fsync parent). A crash
(kill -9) at any point leaves `latest` naming either the previous checkpoint or the new one, and
whatever it names is a complete, renamed directory. Leftovers of a crashed save (temp dirs, a
renamed-but-unacknowledged version) are cleaned by the next `save_checkpoint` or `prune`.

Invariant 4 (monotonic versions): `save_checkpoint` refuses a version below the acknowledged one,
and `load_latest` loads the acknowledged one. When that one is damaged (a file missing, a sha256
mismatch) it logs a warning and falls back to the newest older intact checkpoint rather than fail
the service; the controller then replays the training batches after it. For that replay to be
possible the journal must keep the batches after the *fallback* checkpoint too, i.e. prune journal
batches only up to the step of the second newest retained checkpoint (`prune(keep=2)`).

Nothing is pickled: tensors are safetensors, everything else JSON. One writer per
`<root>/<service>` (an flock on `<service>/.lock` serialises save and prune); readers take no lock.
Callers run these blocking functions off the event loop (`asyncio.to_thread`) and must not step the
optimizer while a save runs (hold the trainer's lock).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
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
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

log = logging.getLogger(__name__)

FORMAT = 1
MODEL_FILE = "model.safetensors"
OPTIM_TENSORS_FILE = "optimizer.safetensors"
OPTIM_JSON_FILE = "optimizer.json"
META_FILE = "meta.json"
LATEST = "latest"
_LOCK_FILE = ".lock"

_SERVICE_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$")
# `:08d` pads; versions past 99,999,999 simply get more digits and still parse.
_VERSION_DIR_RE = re.compile(r"^v(\d{8,})$")
# Names our own crashed saves and prunes leave behind (dot-prefixed, so never a version dir).
_LEFTOVER_RE = re.compile(r"^\.(v\d+\.tmp-|latest\.tmp-|trash-)")


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

    @property
    def has_optimizer(self) -> bool:
        return OPTIM_TENSORS_FILE in self.sha256


def version_dir_name(version: int) -> str:
    return f"v{version:08d}"


# -- public API --------------------------------------------------------------------------------


def save_checkpoint(
    root: Path,
    service: str,
    version: int,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> Path:
    """`_save_checkpoint`, with a full disk raised as `CheckpointDiskFull` (never half a checkpoint)."""
    try:
        return _save_checkpoint(root, service, version, step, model, optimizer)
    except CheckpointError:
        raise
    except Exception as err:
        if not _is_disk_full(err):
            raise
        try:
            free = f"{shutil.disk_usage(root).free} bytes free"
        except OSError:
            free = "free space unknown"
        raise CheckpointDiskFull(
            f"{service} checkpoint version {version} was not written to {root}: the disk is full ({free});"
            " the previous checkpoint stays latest"
        ) from err


def _is_disk_full(err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # safetensors reports I/O failures as its own error type, with the OS message inside.
    return os.strerror(errno.ENOSPC) in str(err) or os.strerror(errno.EDQUOT) in str(err)


def _save_checkpoint(
    root: Path,
    service: str,
    version: int,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> Path:
    """Write checkpoint `version` of `service` and make it `latest`; returns its directory.

    When this returns, the checkpoint is durable and acknowledged. A version below the latest raises
    `CheckpointError`. Saving the latest version again is a no-op when the existing one is intact,
    was taken at the same step and holds optimizer state if `optimizer` is given (a drain right after
    a periodic checkpoint): versions advance exactly once per training step, so one version number
    always means the same weights. A same-version save that differs otherwise raises; a damaged
    latest checkpoint is written again."""
    if version < 0 or step < 0:
        raise CheckpointError(f"version and step must be >= 0, got version={version}, step={step}")
    sdir = _service_dir(root, service)
    _mkdir_durable(sdir)
    final = sdir / version_dir_name(version)
    with _locked(sdir):
        _remove_leftovers(sdir)
        floor, pointed = _acknowledged_version(sdir)
        if floor is not None and version < floor:
            raise CheckpointError(
                f"refusing to save {service} version {version} to {final}: version {floor} is already"
                " checkpointed and versions never go back (DESIGN.md invariant 4)"
            )
        if floor is not None and version == floor and pointed is not None:
            try:
                existing = verify_checkpoint(pointed, service)
            except CheckpointCorrupt as err:
                log.warning("checkpoint %s is damaged (%s); writing it again", pointed, err)
            else:
                # Rewriting an intact acknowledged checkpoint is not atomic (a non-empty directory
                # cannot be renamed over), so a same-version save that differs is refused instead.
                if existing.step != step:
                    raise CheckpointError(
                        f"{service} version {version} is already checkpointed at step {existing.step}"
                        f" ({pointed}); refusing to record it again at step {step}"
                    )
                if optimizer is not None and not existing.has_optimizer:
                    raise CheckpointError(
                        f"{service} version {version} is already checkpointed without optimizer state"
                        f" ({pointed}); save the next version to add it"
                    )
                log.info("checkpoint %s already holds %s version %d; nothing to write", pointed, service, version)
                return pointed

        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=sdir))
        try:
            _write_contents(tmp, service, version, step, model, optimizer)
            _fsync_dir(tmp)
            if final.exists():
                # A version dir that exists here is either unacknowledged (left by a save that died
                # between its rename and `latest`) or the acknowledged one found damaged above. It
                # cannot be replaced by one rename (rename onto a non-empty dir fails), so move it
                # out of the way first. Nothing points at it, or what it points at is damaged anyway.
                _discard(final, sdir)
            os.rename(tmp, final)
            _fsync_dir(sdir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        _write_pointer(sdir, final.name)  # last: this is the acknowledgement
        _remove_leftovers(sdir)
    log.info("checkpointed %s version %d (step %d) at %s", service, version, step, final)
    return final


def load_latest(
    root: Path, service: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> CheckpointMeta | None:
    """Load the acknowledged checkpoint of `service` into `model` (and `optimizer`) in place.

    Returns None when `service` has never acknowledged a checkpoint. A damaged latest checkpoint is
    skipped with a warning for the newest older intact one. Raises `CheckpointMismatch` when an
    intact checkpoint does not fit the modules, and `CheckpointError` when none is intact."""
    sdir = _service_dir(root, service)
    try:
        pointed = _read_pointer(sdir)
    except CheckpointCorrupt as err:
        log.warning("%s; trying every checkpoint of %s, newest first", err, service)
        candidates = _version_dirs(sdir)
    else:
        if pointed is None:
            return None
        floor = _parse_version_dir(pointed)
        assert floor is not None  # _read_pointer only returns version dir names
        older = [d for d in _version_dirs(sdir) if _version_of(d) < floor]
        candidates = [sdir / pointed, *older]
    failures: list[str] = []
    for path in candidates:
        try:
            meta = load_checkpoint(path, model, optimizer, service=service)
        except CheckpointCorrupt as err:
            log.warning("checkpoint %s is unusable: %s; falling back to the previous one", path, err)
            failures.append(str(err))
            continue
        if failures:
            log.warning(
                "loaded %s version %d from the older checkpoint %s after %d damaged one(s); the"
                " controller must replay the training batches after step %d",
                service, meta.version, path, len(failures), meta.step,
            )
        return meta
    raise CheckpointError(
        f"no intact checkpoint of {service} under {sdir}: " + ("; ".join(failures) or "no version directories")
    )


def latest_meta(root: Path, service: str) -> CheckpointMeta | None:
    """Metadata of the acknowledged checkpoint (meta.json only; file hashes are not re-checked).

    None when there is none; `CheckpointCorrupt` when the pointer or meta.json cannot be read."""
    sdir = _service_dir(root, service)
    pointed = _read_pointer(sdir)
    if pointed is None:
        return None
    return _read_meta(sdir / pointed, service)


def verify_checkpoint(path: Path, service: str | None = None) -> CheckpointMeta:
    """Check every file of the checkpoint at `path` against meta.json (size and sha256).

    Raises `CheckpointCorrupt` naming the first bad file."""
    path = Path(path)
    meta = _read_meta(path, service)
    for name, want in meta.sha256.items():
        f = path / name
        try:
            size = f.stat().st_size
            if size != meta.sizes[name]:
                raise CheckpointCorrupt(f"{f} is {size} bytes, meta.json says {meta.sizes[name]}")
            got = _sha256(f)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{f} is missing") from None
        except OSError as err:
            raise CheckpointCorrupt(f"{f} cannot be read: {err}") from err
        if got != want:
            raise CheckpointCorrupt(f"{f} has sha256 {got[:12]}..., meta.json says {want[:12]}...")
    return meta


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    service: str | None = None,
) -> CheckpointMeta:
    """Verify the checkpoint directory `path`, then load it into `model` (and `optimizer`) in place.

    Everything is verified before either module is touched, so a damaged checkpoint never leaves a
    half-loaded model behind. Parameters are copied into the existing tensors (the optimizer keeps
    pointing at them); their dtype and device stay as they are."""
    path = Path(path)
    meta = verify_checkpoint(path, service)
    opt_state: dict[str, Any] | None = None
    if optimizer is not None:
        if not meta.has_optimizer:
            raise CheckpointMismatch(f"checkpoint {path} holds no optimizer state, but an optimizer was given")
        opt_state = _read_optimizer_state(path, optimizer)
    try:
        # Handles tied weights: the file holds one of the shared names, load_model ties the rest.
        load_model(model, path / MODEL_FILE, strict=True)
    except (RuntimeError, ValueError) as err:
        raise CheckpointMismatch(f"{path / MODEL_FILE} does not fit {type(model).__name__}: {err}") from err
    if optimizer is not None and opt_state is not None:
        try:
            optimizer.load_state_dict(opt_state)
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointMismatch(
                f"{path / OPTIM_JSON_FILE} does not fit {type(optimizer).__name__}: {err}"
            ) from err
    return meta


def prune(root: Path, service: str, keep: int = 2) -> list[Path]:
    """Delete all but the `keep` newest checkpoints up to the acknowledged one; returns what went.

    The acknowledged checkpoint is always kept; the others kept are the fallbacks of `load_latest`.
    Unacknowledged version dirs newer than `latest` (a save that died before its pointer) and
    leftovers of crashed saves go too. Without a readable `latest`, only those leftovers go."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the latest checkpoint is never pruned), got {keep}")
    sdir = _service_dir(root, service)
    if not sdir.is_dir():
        return []
    removed: list[Path] = []
    with _locked(sdir):
        _remove_leftovers(sdir)
        try:
            pointed = _read_pointer(sdir)
        except CheckpointCorrupt as err:
            log.warning("%s; pruning nothing", err)
            return []
        if pointed is None:
            return []
        floor = _parse_version_dir(pointed)
        assert floor is not None
        dirs = _version_dirs(sdir)  # newest first
        older = [d for d in dirs if _version_of(d) < floor]
        kept = {pointed} | {d.name for d in older[: keep - 1]}
        for d in dirs:
            if d.name not in kept:
                _discard(d, sdir)
                removed.append(d)
        _remove_leftovers(sdir)
    if removed:
        log.info("pruned %d checkpoint(s) of %s: %s", len(removed), service, ", ".join(d.name for d in removed))
    return removed


# -- writing -----------------------------------------------------------------------------------


def _write_contents(
    tmp: Path, service: str, version: int, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    # save_model drops all but one name of tensors sharing storage (tied embeddings), which plain
    # save_file refuses; load_model re-ties them on load.
    save_model(model, str(tmp / MODEL_FILE), force_contiguous=True)
    names = [MODEL_FILE]
    if optimizer is not None:
        tensors, doc = _split_optimizer_state(optimizer)
        save_file(tensors, str(tmp / OPTIM_TENSORS_FILE))
        _write_bytes(tmp / OPTIM_JSON_FILE, _json_bytes(doc, indent=None))
        names += [OPTIM_TENSORS_FILE, OPTIM_JSON_FILE]
    files: dict[str, dict[str, Any]] = {}
    for name in names:
        f = tmp / name
        _fsync_file(f)  # safetensors writes without fsync; _write_bytes already synced, cheap again
        files[name] = {"sha256": _sha256(f), "bytes": f.stat().st_size}
    meta = {
        "format": FORMAT,
        "service": service,
        "version": version,
        "step": step,
        "created_at": time.time(),
        "files": files,
    }
    _write_bytes(tmp / META_FILE, _json_bytes(meta))  # last file of the directory


def _split_optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer state dict -> (tensors for safetensors, JSON document).

    Per-parameter tensors (exp_avg, exp_avg_sq, ...) go to safetensors as `state.<index>.<name>`.
    Scalars, including AdamW's 0-d `step` tensors and a tensor lr, go to JSON with their dtype, so
    the step counts are readable and the round trip is exact (a float32 count is an exact double)."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    state_doc: dict[str, dict[str, Any]] = {}
    for index, per_param in sd["state"].items():
        entry: dict[str, Any] = {}
        for name, value in per_param.items():
            where = f"state.{index}.{name}"
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[where] = value.detach().contiguous()
            else:
                entry[name] = _to_json(value, where)
        state_doc[str(index)] = entry
    groups = [
        {k: (list(v) if k == "params" else _to_json(v, f"param_groups.{g}.{k}")) for k, v in group.items()}
        for g, group in enumerate(sd["param_groups"])
    ]
    return tensors, {
        "format": FORMAT,
        "class": type(optimizer).__name__,
        "param_groups": groups,
        "state": state_doc,
    }


def _to_json(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise CheckpointError(f"optimizer {where} is a tensor of shape {tuple(value.shape)}; only scalars fit JSON")
        return {"$scalar": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):  # betas: kept a tuple so the restored state dict equals the saved one
        return {"$tuple": [_to_json(v, where) for v in value]}
    if isinstance(value, list):
        return [_to_json(v, where) for v in value]
    raise CheckpointError(f"optimizer {where} is a {type(value).__name__}, which a checkpoint cannot hold")


def _from_json(value: Any, where: str) -> Any:
    if isinstance(value, list):
        return [_from_json(v, where) for v in value]
    if isinstance(value, dict):
        if "$tuple" in value:
            return tuple(_from_json(v, where) for v in value["$tuple"])
        if "$scalar" in value:
            dtype = getattr(torch, str(value.get("dtype")), None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointCorrupt(f"optimizer {where}: unknown dtype {value.get('dtype')!r}")
            return torch.tensor(value["$scalar"], dtype=dtype)
        raise CheckpointCorrupt(f"optimizer {where}: unexpected object {sorted(value)}")
    return value


# -- reading -----------------------------------------------------------------------------------


def _read_meta(path: Path, service: str | None) -> CheckpointMeta:
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
        )
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointCorrupt(f"{f} is malformed: {type(err).__name__}: {err}") from err
    if MODEL_FILE not in meta.sha256:
        raise CheckpointCorrupt(f"{f} lists no {MODEL_FILE}")
    if service is not None and meta.service != service:
        raise CheckpointCorrupt(f"{f} belongs to service {meta.service!r}, not {service!r}")
    dir_version = _parse_version_dir(path.name)
    if dir_version is not None and dir_version != meta.version:
        raise CheckpointCorrupt(f"{f} says version {meta.version} but lives in {path.name}")
    return meta


def _read_optimizer_state(path: Path, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state dict of an already verified checkpoint (sha256 matched)."""
    try:
        doc = json.loads((path / OPTIM_JSON_FILE).read_bytes())
        tensors = load_file(str(path / OPTIM_TENSORS_FILE))
    except (OSError, ValueError) as err:
        raise CheckpointCorrupt(f"optimizer state in {path} cannot be read: {err}") from err
    if doc.get("class") != type(optimizer).__name__:
        raise CheckpointMismatch(
            f"{path / OPTIM_JSON_FILE} holds {doc.get('class')} state, not {type(optimizer).__name__}"
        )
    try:
        state: dict[int, dict[str, Any]] = {
            int(index): {name: _from_json(v, f"state.{index}.{name}") for name, v in entry.items()}
            for index, entry in doc["state"].items()
        }
        for key, tensor in tensors.items():
            prefix, index, name = key.split(".", 2)
            if prefix != "state":
                raise ValueError(f"unexpected tensor {key!r}")
            state.setdefault(int(index), {})[name] = tensor
        groups = [
            {k: (v if k == "params" else _from_json(v, f"param_groups.{g}.{k}")) for k, v in group.items()}
            for g, group in enumerate(doc["param_groups"])
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        # The sha256 matched, so this is a file we wrote wrongly, not disk damage; still unusable.
        raise CheckpointCorrupt(f"optimizer state in {path} is malformed: {type(err).__name__}: {err}") from err
    return {"state": state, "param_groups": groups}


# -- the pointer and the directory -------------------------------------------------------------


def _service_dir(root: Path, service: str) -> Path:
    if not _SERVICE_RE.match(service):
        raise ValueError(f"service name must match {_SERVICE_RE.pattern}, got {service!r}")
    return Path(root) / service


def _parse_version_dir(name: str) -> int | None:
    m = _VERSION_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def _version_of(path: Path) -> int:
    v = _parse_version_dir(path.name)
    assert v is not None
    return v


def _version_dirs(sdir: Path) -> list[Path]:
    """Version directories of a service, newest first."""
    if not sdir.is_dir():
        return []
    dirs = [p for p in sdir.iterdir() if _parse_version_dir(p.name) is not None and p.is_dir()]
    return sorted(dirs, key=_version_of, reverse=True)


def _read_pointer(sdir: Path) -> str | None:
    """The directory name `latest` holds; None when there is no `latest` (nothing acknowledged)."""
    f = sdir / LATEST
    try:
        text = f.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointCorrupt(f"{f} cannot be read: {err}") from err
    if _parse_version_dir(text) is None:
        raise CheckpointCorrupt(f"{f} holds {text[:40]!r}, not a version directory name")
    return text


def _acknowledged_version(sdir: Path) -> tuple[int | None, Path | None]:
    """(the version saves must not go below, the directory `latest` names)."""
    try:
        pointed = _read_pointer(sdir)
    except CheckpointCorrupt as err:
        # `latest` is only ever replaced by rename, so this takes outside damage. Stay conservative:
        # no version below any existing directory.
        dirs = _version_dirs(sdir)
        log.warning("%s; treating the newest directory as the floor for new versions", err)
        return (_version_of(dirs[0]) if dirs else None), None
    if pointed is None:
        return None, None
    return _parse_version_dir(pointed), sdir / pointed


def _write_pointer(sdir: Path, name: str) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{LATEST}.tmp-", dir=sdir)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(f"{name}\n".encode("ascii"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, sdir / LATEST)
        _fsync_dir(sdir)
    finally:
        if tmp.exists():
            tmp.unlink()


def _discard(path: Path, sdir: Path) -> None:
    """Remove a directory so that it vanishes from its name at once: rename, then delete. A crash
    mid-delete leaves a dot-named leftover, never a half directory under a version name."""
    trash = sdir / f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}"
    os.rename(path, trash)
    _fsync_dir(sdir)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_leftovers(sdir: Path) -> None:
    # Only under the service lock: a live save's temp dir must not be taken for a crashed one's.
    for p in sdir.iterdir():
        if _LEFTOVER_RE.match(p.name):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()


@contextlib.contextmanager
def _locked(sdir: Path) -> Iterator[None]:
    # flock dies with its process, so a writer killed mid-save never blocks its replacement.
    fd = os.open(sdir / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# -- files -------------------------------------------------------------------------------------


def _json_bytes(doc: Any, indent: int | None = 1) -> bytes:
    return json.dumps(doc, indent=indent, sort_keys=True).encode()


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (a create, a rename) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as err:
        # Some filesystems cannot fsync a directory at all; there is nothing stronger to do there.
        # Any other failure (EIO) means the rename may not be durable: the caller must know.
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        log.debug("fsync of directory %s is not supported: %s", path, err)
    finally:
        os.close(fd)


def _mkdir_durable(path: Path) -> None:
    """mkdir -p, with every new directory entry fsynced into its parent."""
    created: list[Path] = []
    p = path
    while not p.exists():
        created.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    for new in created:
        _fsync_dir(new.parent)

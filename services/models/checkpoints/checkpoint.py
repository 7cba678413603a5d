"""Crash-safe checkpoints of a trainable service (actor: causal LM + AdamW; critic: ValueModel + AdamW).
A LoRA actor (models.policy.lora) checkpoints its adapters only, in peft's naming (services/models/nets/lora.py).

Layout, one directory per service under a shared root:

    <root>/<service>/v00000007/model.safetensors       the module's state dict (tied weights stored once)
                              optimizer.safetensors   optimizer state tensors, `state.<param_index>.<name>`
                              optimizer.json          param_groups hyper-params, step counts, other scalars
                              meta.json               service, version, step, created_at, sha256 per file
    <root>/<service>/latest                           "v00000007": the acknowledged checkpoint

Protocol (docs/architecture.md, "Durability"): everything is written into a temporary directory beside the
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

import errno
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from services.models.checkpoints.dcp import DCP_DIR, files_of, load_dcp
from services.models.checkpoints.layout import (
    FORMAT,
    META_FILE,
    MODEL_FILE,
    OPTIM_JSON_FILE,
    OPTIM_TENSORS_FILE,
    CheckpointCorrupt,
    CheckpointDiskFull,
    CheckpointError,
    CheckpointMeta,
    CheckpointMismatch,
    acknowledged_version,
    discard,
    locked,
    parse_version_dir,
    read_meta,
    read_pointer,
    remove_leftovers,
    service_dir,
    version_dir_name,
    version_dirs,
    version_of,
    write_pointer,
)
from services.models.checkpoints.optim import read_optimizer_state, split_optimizer_state
from services.models.engine import WeightSyncError
from services.models.io.durable import fsync_dir, fsync_file, json_bytes, mkdir_durable, sha256, write_bytes
from services.models.nets.lora import adapter_state, is_lora, load_adapter_state

# The errors and the metadata are part of this module's API; their home is the layout module.
__all__ = [
    "CheckpointCorrupt", "CheckpointDiskFull", "CheckpointError",
    "CheckpointMeta", "CheckpointMismatch", "latest_meta", "load_checkpoint",
    "load_latest", "prune", "save_checkpoint", "verify_checkpoint", "version_dir_name",
]

log = logging.getLogger(__name__)

# A multi-rank trainer writes its checkpoint through its ranks: given the temporary version
# directory, every rank writes its DCP shards under `dcp/` (checkpoint_dcp.save_dcp).
RankWrite = Callable[[Path], None]
# ...and loads one through them: (the verified checkpoint, the optimizer state of a one-rank
# checkpoint read on this rank, else None).
RankLoad = Callable[[CheckpointMeta, "dict[str, Any] | None"], None]


# -- public API --------------------------------------------------------------------------------


def save_checkpoint(
    root: Path,
    service: str,
    version: int,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rank_write: RankWrite | None = None,
) -> Path:
    """`_save_checkpoint`, with a full disk raised as `CheckpointDiskFull` (never half a checkpoint)."""
    try:
        return _save_checkpoint(root, service, version, step, model, optimizer, rank_write)
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
    rank_write: RankWrite | None = None,
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
    sdir = service_dir(root, service)
    mkdir_durable(sdir)
    final = sdir / version_dir_name(version)
    with locked(sdir):
        remove_leftovers(sdir)
        floor, pointed = acknowledged_version(sdir)
        if floor is not None and version < floor:
            raise CheckpointError(
                f"refusing to save {service} version {version} to {final}: version {floor} is already"
                " checkpointed and versions never go back (invariant 4, docs/architecture.md)"
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
            _write_contents(tmp, service, version, step, model, optimizer, rank_write)
            fsync_dir(tmp)
            if final.exists():
                # A version dir that exists here is either unacknowledged (left by a save that died
                # between its rename and `latest`) or the acknowledged one found damaged above. It
                # cannot be replaced by one rename (rename onto a non-empty dir fails), so move it
                # out of the way first. Nothing points at it, or what it points at is damaged anyway.
                discard(final, sdir)
            os.rename(tmp, final)
            fsync_dir(sdir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        write_pointer(sdir, final.name)  # last: this is the acknowledgement
        remove_leftovers(sdir)
    log.info("checkpointed %s version %d (step %d) at %s", service, version, step, final)
    return final


def load_latest(
    root: Path, service: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
    rank_load: RankLoad | None = None,
) -> CheckpointMeta | None:
    """Load the acknowledged checkpoint of `service` into `model` (and `optimizer`) in place.

    Returns None when `service` has never acknowledged a checkpoint. A damaged latest checkpoint is
    skipped with a warning for the newest older intact one. Raises `CheckpointMismatch` when an
    intact checkpoint does not fit the modules, and `CheckpointError` when none is intact."""
    sdir = service_dir(root, service)
    try:
        pointed = read_pointer(sdir)
    except CheckpointCorrupt as err:
        log.warning("%s; trying every checkpoint of %s, newest first", err, service)
        candidates = version_dirs(sdir)
    else:
        if pointed is None:
            return None
        floor = parse_version_dir(pointed)
        assert floor is not None  # read_pointer only returns version dir names
        older = [d for d in version_dirs(sdir) if version_of(d) < floor]
        candidates = [sdir / pointed, *older]
    failures: list[str] = []
    for path in candidates:
        try:
            meta = load_checkpoint(path, model, optimizer, service=service, rank_load=rank_load)
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
    sdir = service_dir(root, service)
    pointed = read_pointer(sdir)
    if pointed is None:
        return None
    return read_meta(sdir / pointed, service)


def verify_checkpoint(path: Path, service: str | None = None) -> CheckpointMeta:
    """Check every file of the checkpoint at `path` against meta.json (size and sha256).

    Raises `CheckpointCorrupt` naming the first bad file."""
    path = Path(path)
    meta = read_meta(path, service)
    for name, want in meta.sha256.items():
        f = path / name
        try:
            size = f.stat().st_size
            if size != meta.sizes[name]:
                raise CheckpointCorrupt(f"{f} is {size} bytes, meta.json says {meta.sizes[name]}")
            got = sha256(f)
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
    rank_load: RankLoad | None = None,
) -> CheckpointMeta:
    """Verify the checkpoint directory `path`, then load it into `model` (and `optimizer`) in place.

    Everything is verified before either module is touched, so a damaged checkpoint never leaves a
    half-loaded model behind. Parameters are copied into the existing tensors (the optimizer keeps
    pointing at them); their dtype and device stay as they are. Either layout loads into any
    number of ranks: a multi-rank trainer passes `rank_load`; a DCP checkpoint loads into one
    rank (or an export's plain model) by DCP's own resharding."""
    path = Path(path)
    meta = verify_checkpoint(path, service)
    opt_state: dict[str, Any] | None = None
    if meta.layout == "dcp" and rank_load is None:
        try:
            load_dcp(path / DCP_DIR, model, optimizer)
        except Exception as err:
            raise CheckpointMismatch(f"{path / DCP_DIR} does not fit {type(model).__name__}: {err}") from err
        return meta
    if optimizer is not None and meta.layout != "dcp":
        if not meta.has_optimizer:
            raise CheckpointMismatch(f"checkpoint {path} holds no optimizer state, but an optimizer was given")
        opt_state = read_optimizer_state(path, optimizer)
    if rank_load is not None:
        try:
            rank_load(meta, opt_state)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointMismatch(f"checkpoint {path} does not fit the {service} trainer ranks: {err}") from err
        return meta
    try:
        if is_lora(model):  # the adapters only; the frozen base came from models.policy.path
            load_adapter_state(model, load_file(str(path / MODEL_FILE)))  # type: ignore[arg-type]
        else:
            # Handles tied weights: the file holds one of the shared names, load_model ties the rest.
            load_model(model, path / MODEL_FILE, strict=True)
    except (RuntimeError, ValueError, WeightSyncError) as err:
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
    sdir = service_dir(root, service)
    if not sdir.is_dir():
        return []
    removed: list[Path] = []
    with locked(sdir):
        remove_leftovers(sdir)
        try:
            pointed = read_pointer(sdir)
        except CheckpointCorrupt as err:
            log.warning("%s; pruning nothing", err)
            return []
        if pointed is None:
            return []
        floor = parse_version_dir(pointed)
        assert floor is not None
        dirs = version_dirs(sdir)  # newest first
        older = [d for d in dirs if version_of(d) < floor]
        kept = {pointed} | {d.name for d in older[: keep - 1]}
        for d in dirs:
            if d.name not in kept:
                discard(d, sdir)
                removed.append(d)
        remove_leftovers(sdir)
    if removed:
        log.info("pruned %d checkpoint(s) of %s: %s", len(removed), service, ", ".join(d.name for d in removed))
    return removed


# -- writing -----------------------------------------------------------------------------------


def _write_contents(
    tmp: Path, service: str, version: int, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
    rank_write: RankWrite | None = None,
) -> None:
    extra: dict[str, Any] = {}
    if rank_write is not None:
        rank_write(tmp)
        names = [str(f.relative_to(tmp)) for f in files_of(tmp / DCP_DIR)]
        extra = {"layout": "dcp", "ranks": _ranks(tmp / DCP_DIR)}
    else:
        names = _write_safetensors(tmp, model, optimizer)
    files: dict[str, dict[str, Any]] = {}
    for name in names:
        f = tmp / name
        fsync_file(f)  # safetensors and DCP write without fsync; write_bytes already synced, cheap again
        files[name] = {"sha256": sha256(f), "bytes": f.stat().st_size}
    if rank_write is not None:
        fsync_dir(tmp / DCP_DIR)
    meta = {
        "format": FORMAT,
        "service": service,
        "version": version,
        "step": step,
        "created_at": time.time(),
        "files": files,
        **extra,
    }
    write_bytes(tmp / META_FILE, json_bytes(meta))  # last file of the directory


def _ranks(directory: Path) -> int:
    # DCP names each rank's file __<rank>_<n>.distcp.
    return len({f.name.split("_")[2] for f in directory.glob("__*_*.distcp")}) or 1


def _write_safetensors(tmp: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[str]:
    if is_lora(model):
        # A LoRA policy's base never changes: its checkpoint is the adapters (optimizer state
        # below is theirs too), in peft's naming.
        save_file(adapter_state(model), str(tmp / MODEL_FILE))  # type: ignore[arg-type]
    else:
        # save_model drops all but one name of tensors sharing storage (tied embeddings), which plain
        # save_file refuses; load_model re-ties them on load.
        save_model(model, str(tmp / MODEL_FILE), force_contiguous=True)
    names = [MODEL_FILE]
    if optimizer is not None:
        tensors, doc = split_optimizer_state(optimizer)
        save_file(tensors, str(tmp / OPTIM_TENSORS_FILE))
        write_bytes(tmp / OPTIM_JSON_FILE, json_bytes(doc, indent=None))
        names += [OPTIM_TENSORS_FILE, OPTIM_JSON_FILE]
    return names

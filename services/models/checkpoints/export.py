"""What a run gives back: the actor's checkpoint as a `save_pretrained` directory with its tokenizer.

The checkpoint (`RUN_DIR/checkpoints/actor/vNNNNNNNN/model.safetensors`, see checkpoint.py) holds the
policy's state dict only; the architecture, generation config, tokenizer and chat template live in
the base model directory the run started from (`models.policy.path` in `RUN_DIR/fleet.yaml` or
`RUN_DIR/local.yaml`, the resolved configs of a fleet and a local run, or `RUN_DIR/models/policy`;
paths there inside the run directory they recorded are looked up under the RUN_DIR given, so a
compose run's volume exports on the host, where it is mounted elsewhere).
An export loads the base architecture, loads the verified checkpoint into it, and writes both, so
`AutoModelForCausalLM.from_pretrained(out)` scores exactly like the trainer. The output is written
beside its target and renamed into place: never a half-written export.

A LoRA run (models.policy.lora) checkpoints its adapters only; its export is, as asked, the base
with the adapters merged by peft (`merged`, a plain model directory) or the peft adapter directory
itself (`adapter`, for `PeftModel.from_pretrained` on the base).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import yaml
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.core.config.run import ConfigError, ModelSpec, RunConfig, load_config
from services.models.checkpoints.checkpoint import CheckpointError, latest_meta, load_checkpoint, version_dir_name
from services.models.checkpoints.layout import DCP_DIR, LATEST, MODEL_FILE
from services.models.io.atomic import staging_dir
from services.models.io.loading import ModelLoadError, load_tokenizer, require_model_dir, torch_dtype
from services.models.nets.lora import apply_lora

log = logging.getLogger(__name__)

SERVICE = "actor"
EXPORT_DIR = "export"
INFO_FILE = "rlfleet_export.json"
FLEET_CONFIG = "fleet.yaml"
LOCAL_CONFIG = "local.yaml"

# safetensors header dtypes a checkpoint of ours can hold.
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

# What the export of a LoRA run holds: the merged model, or the adapter alone.
LoraExport = Literal["merged", "adapter"]
LORA_EXPORTS: tuple[LoraExport, ...] = ("merged", "adapter")


class ExportError(RuntimeError):
    """An export that cannot be made as asked; the message names the path or version."""


@dataclass(frozen=True)
class Exported:
    out: Path
    version: int
    step: int
    base: Path
    checkpoint: Path


def record_local_config(cfg: RunConfig, policy_path: Path) -> Path:
    """Write RUN_DIR/local.yaml, the resolved config of a `train --local` run (what fleet.yaml is to
    a fleet run), so an export later finds the base model and the checkpoints from the run dir alone."""
    data = cfg.model_dump(mode="json")
    data["run"]["dir"] = str(cfg.run_dir.resolve())
    data["models"]["policy"]["path"] = str(Path(policy_path).resolve())
    data["checkpoint"]["dir"] = str(cfg.checkpoint_dir.resolve())
    out = cfg.run_dir / LOCAL_CONFIG
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, out)
    return out


def _fleet_policy_and_checkpoints(run_dir: Path) -> tuple[Path | None, Path, ModelSpec | None]:
    """(models.policy.path, checkpoint root, models.policy) as the run saw them: from
    RUN_DIR/fleet.yaml (a fleet run) or RUN_DIR/local.yaml (a local run)."""
    for name in FLEET_CONFIG, LOCAL_CONFIG:
        resolved = run_dir / name
        if resolved.is_file():
            break
    else:
        return None, run_dir / "checkpoints", None
    try:
        cfg = load_config(resolved)
    except ConfigError as err:
        raise ExportError(f"cannot read {resolved}: {str(err).splitlines()[0]}") from None
    path = Path(cfg.models.policy.path) if cfg.models.policy.path else None
    return (_moved(path, cfg.run_dir, run_dir) if path else None, _moved(cfg.checkpoint_dir, cfg.run_dir, run_dir),
            cfg.models.policy)


def _moved(path: Path, recorded: Path, run_dir: Path) -> Path:
    """A path inside the run directory the config recorded, found under `run_dir` instead: a run read
    through another mount point (a container's volume, exported on the host) or moved since."""
    try:
        return run_dir / path.relative_to(recorded)
    except ValueError:
        return path


def find_base(run_dir: Path) -> Path:
    """The model directory the run's policy started from."""
    path, _, _ = _fleet_policy_and_checkpoints(run_dir)
    if path is None:
        path = run_dir / "models" / "policy"
        if not (path / "config.json").is_file():
            raise ExportError(f"cannot tell which model {run_dir} trained: it has no {FLEET_CONFIG}, no"
                              f" {LOCAL_CONFIG} and no {path}; pass --base MODEL_DIR (the run's models.policy.path)")
    return path


def _checkpoint_dir(root: Path, version: int | None) -> Path:
    sdir = root / SERVICE
    if version is None:
        try:
            meta = latest_meta(root, SERVICE)
        except CheckpointError as err:
            raise ExportError(f"the latest {SERVICE} checkpoint is unreadable: {err}") from None
        if meta is None:
            raise ExportError(f"no {SERVICE} checkpoint in {sdir} (no {LATEST}): the run has not checkpointed"
                              " a trained version yet")
        return meta.path
    path = sdir / version_dir_name(version)
    if not path.is_dir():
        have = sorted(int(p.name[1:]) for p in sdir.glob("v[0-9]*") if p.is_dir() and p.name[1:].isdigit())
        listed = ", ".join(map(str, have)) if have else "none"
        raise ExportError(f"no {SERVICE} checkpoint of version {version} in {sdir} (versions there: {listed})")
    return path


def _checkpoint_dtype(path: Path) -> torch.dtype:
    """The dtype the trainer held the weights in: load the base in it, so nothing is rounded."""
    if (path / DCP_DIR).is_dir():  # a multi-rank trainer's checkpoint: DCP's metadata has the dtypes
        md = FileSystemReader(str(path / DCP_DIR)).read_metadata().state_dict_metadata
        dtypes = {m.properties.dtype for k, m in md.items() if k.startswith("model.") and hasattr(m, "properties")}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _ST_DTYPES.values():
            raise ExportError(f"{path / DCP_DIR} holds {sorted(map(str, dtypes))} weights; an export reads one of"
                              f" {', '.join(_ST_DTYPES)}")
        return next(iter(dtypes))
    with safe_open(str(path / MODEL_FILE), framework="pt") as f:
        keys = list(f.keys())
        if not keys:
            raise ExportError(f"{path / MODEL_FILE} holds no tensors")
        dtype = f.get_slice(keys[0]).get_dtype()
    if dtype not in _ST_DTYPES:
        raise ExportError(f"{path / MODEL_FILE} holds {dtype} tensors; an export reads {', '.join(_ST_DTYPES)}")
    return _ST_DTYPES[dtype]


def load_checkpointed_policy(base: Path, checkpoint: Path,
                             spec: ModelSpec | None = None) -> tuple[PreTrainedModel, int, int]:
    """The base architecture with the verified checkpoint's weights: (model, version, step). With
    `spec.lora` set the model is the base (in `spec.dtype`) wrapped in the checkpoint's adapters."""
    base = require_model_dir(base, "base model")
    lora = spec.lora if spec is not None else None
    # An adapter checkpoint's dtype is the adapters' (peft keeps them in float32), not the base's.
    dtype = torch_dtype(spec.dtype) if spec is not None and lora is not None else _checkpoint_dtype(checkpoint)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype, local_files_only=True)
    except Exception as err:
        raise ExportError(f"cannot load the base model {base}: {type(err).__name__}: {err}") from err
    if lora is not None:
        try:
            model = apply_lora(model, lora, seed=0)  # type: ignore[assignment]  # the checkpoint overwrites the init
        except ConfigError as err:
            raise ExportError(str(err)) from None
    try:
        meta = load_checkpoint(checkpoint, model, service=SERVICE)
    except CheckpointError as err:
        raise ExportError(f"cannot load checkpoint {checkpoint} into {base}: {err}") from None
    model.eval()
    return model, meta.version, meta.step


def _write(tmp: Path, run_dir: Path, base: Path, checkpoint: Path, spec: ModelSpec | None,
           lora: LoraExport) -> tuple[int, int]:
    if lora == "adapter" and (spec is None or spec.lora is None):
        raise ExportError(f"--lora adapter: {run_dir} trained no LoRA adapter (models.policy.lora is unset);"
                          " export the whole model without --lora")
    model, version, step = load_checkpointed_policy(base, checkpoint, spec)
    try:
        tokenizer = load_tokenizer(base)
    except ModelLoadError as err:
        raise ExportError(str(err)) from None
    if spec is not None and spec.lora is not None and lora == "merged":
        model = model.merge_and_unload()  # type: ignore[operator]  # peft's merge: a plain transformers model
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)  # the chat template travels with it
    info = {"run_dir": str(run_dir.resolve()), "service": SERVICE, "version": version, "step": step,
            "base": str(base.resolve()), "checkpoint": str(checkpoint.resolve()), "exported_at": time.time(),
            "lora": lora if spec is not None and spec.lora is not None else None}
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
    return version, step


def _sources(run_dir: Path, version: int | None, base: Path | None) -> tuple[Path, Path, ModelSpec | None]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"run directory {run_dir} does not exist" if not run_dir.exists()
                          else f"run directory {run_dir} is not a directory")
    if version is not None and version < 1:
        raise ExportError(f"--version must be >= 1 (version 0 is the untrained base), got {version}")
    _, root, spec = _fleet_policy_and_checkpoints(run_dir)
    checkpoint = _checkpoint_dir(root, version)
    return (Path(base) if base is not None else find_base(run_dir)), checkpoint, spec


def export_model(run_dir: Path, out: Path, version: int | None = None, base: Path | None = None,
                 lora: LoraExport = "merged") -> Exported:
    """Export checkpoint `version` (default: the latest) of the run's actor into the new directory
    `out`; `lora` says what the export of a LoRA run holds."""
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ExportError(f"--out {out} already exists and is not an empty directory")
    base_dir, checkpoint, spec = _sources(Path(run_dir), version, base)
    with staging_dir(out) as tmp:
        v, step = _write(tmp, Path(run_dir), base_dir, checkpoint, spec, lora)
    if not (out / INFO_FILE).is_file():
        raise ExportError(f"--out {out} appeared while exporting; it holds someone else's files")
    log.info("exported %s version %d (step %d) of %s to %s", SERVICE, v, step, run_dir, out)
    return Exported(out=out, version=v, step=step, base=base_dir, checkpoint=checkpoint)


def export_final(run_dir: Path, base: Path | None = None) -> Exported:
    """Export the latest checkpoint into RUN_DIR/export at the end of a run, replacing an earlier
    export (a run extended with more steps): the new one is complete before the old one goes."""
    run_dir = Path(run_dir)
    out = run_dir / EXPORT_DIR
    base_dir, checkpoint, spec = _sources(run_dir, None, base)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EXPORT_DIR}.tmp-", dir=run_dir))
    try:
        version, step = _write(tmp, run_dir, base_dir, checkpoint, spec, "merged")
        if out.exists():
            old = run_dir / f".{EXPORT_DIR}.old-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported the final %s version %d (step %d) to %s", SERVICE, version, step, out)
    return Exported(out=out, version=version, step=step, base=base_dir, checkpoint=checkpoint)


def export_main(run_dir: str, out: str, version: int | None = None, base: str | None = None,
                lora: LoraExport = "merged") -> int:
    """`rlfleet export`: one line on success (stdout) or failure (stderr)."""
    try:
        done = export_model(Path(run_dir), Path(out), version, Path(base) if base else None, lora=lora)
    except (ExportError, ModelLoadError) as err:
        print(f"export failed: {err}", file=sys.stderr)
        return 1
    print(f"exported {SERVICE} version {done.version} (step {done.step}) of {run_dir} to {done.out}")
    return 0

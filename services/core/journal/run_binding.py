"""Binding a run's journal to its checkpoints, so neither is ever resumed with the other's stranger.

A fresh run gets a random run identity, written first into the journal (`Journal.bind_run_id`)
and then next to the checkpoints (`CHECKPOINT_DIR/RUN_ID`). The controller opens its journal only
through `open_run_journal`, which refuses to start, with one line naming the file, when:

* the journal is missing or empty (`data.mdb` absent or 0 bytes: deleted, truncated, a lost
  volume) while the checkpoints say the run already existed: LMDB would open it as a new journal
  at step 0, and the restored trainable services would then train on a history that is gone;
* the journal and the checkpoints carry different run identities (one of them was copied from
  another run);
* the journal records checkpoints but the checkpoints' identity file is gone (the checkpoint
  directory was deleted or moved): the journal no longer holds the batches to rebuild them.

A journal and checkpoints from before run identities existed are adopted: both get a new identity.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from services.core.config.run import ConfigError, RunConfig
from services.core.journal.journal import Journal, JournalError

log = logging.getLogger(__name__)

RUN_ID_FILE = "RUN_ID"


class RunBindingError(JournalError, ConfigError):
    """The run directory's journal and checkpoints do not belong together; a start-up error."""


def open_run_journal(cfg: RunConfig, *, stages: tuple[str, ...], trainable: tuple[str, ...]) -> Journal:
    """Open the run's journal after checking it belongs to the run's checkpoints (module docstring)."""
    jdir, cdir = cfg.journal_dir, cfg.checkpoint_dir
    data = jdir / "data.mdb"
    ckpt_id = _read_run_id(cdir)
    if ckpt_id is not None and not _has_data(data):
        state = "missing" if not data.exists() else "empty (0 bytes)"
        raise RunBindingError(
            f"journal {data} is {state}, but the checkpoints in {cdir} belong to run {ckpt_id}: restore the"
            " journal from a backup, or start a new run in a fresh run directory"
        )
    j = cfg.journal
    journal = Journal.open(jdir, map_size=j.map_size_bytes, max_map_size=j.max_map_size_bytes,
                           stages=stages, trainable=trainable)
    try:
        _bind(journal, data, cdir, ckpt_id)
        _warn_if_short_of_space(journal, cfg)
    except BaseException:
        journal.close()
        raise
    return journal


def _bind(journal: Journal, data: Path, cdir: Path, ckpt_id: str | None) -> None:
    jid = journal.run_id
    if jid is not None and ckpt_id is not None and jid != ckpt_id:
        raise RunBindingError(
            f"journal {data} belongs to run {jid}, but the checkpoints in {cdir} belong to run {ckpt_id}:"
            " one of them was copied from another run; put back the matching pair"
        )
    if jid is not None and ckpt_id is None:
        recorded = {s: n for s, n in journal.checkpoint_steps.items() if n > 0}
        if recorded:
            where = ", ".join(f"{s} at step {n}" for s, n in sorted(recorded.items()))
            raise RunBindingError(
                f"journal {data} records checkpoints ({where}), but {cdir / RUN_ID_FILE} is missing: the"
                " checkpoint directory was deleted or moved; put it back, or start a new run in a fresh"
                " run directory"
            )
    run_id = jid or ckpt_id or uuid.uuid4().hex
    if jid is None:
        journal.bind_run_id(run_id)  # first: a crash before the file is written is healed next start
    if ckpt_id is None:
        _write_run_id(cdir, run_id)
        log.info("run identity bound", extra={"run_id": run_id, "journal": str(data), "checkpoints": str(cdir)})


def _warn_if_short_of_space(journal: Journal, cfg: RunConfig) -> None:
    need = cfg.journal.min_free_bytes
    free = journal.disk_free_bytes()
    if free < need:
        # Without this line a run directory on a small filesystem just never becomes ready.
        log.error(
            f"journal filesystem of {journal.path} has {free} bytes free, below journal.min_free_bytes={need}:"
            " the controller admits nothing and stays not ready until space is freed or the setting is lowered",
            extra={"free_bytes": free, "min_free_bytes": need},
        )


def _has_data(data: Path) -> bool:
    try:
        return data.stat().st_size > 0
    except FileNotFoundError:
        return False


def _read_run_id(cdir: Path) -> str | None:
    try:
        text = (cdir / RUN_ID_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise RunBindingError(f"cannot read {cdir / RUN_ID_FILE}: {err}") from None
    if not text:
        raise RunBindingError(f"{cdir / RUN_ID_FILE} is empty; it should hold the run identity of {cdir}")
    return text


def _write_run_id(cdir: Path, run_id: str) -> None:
    """Write-then-rename, fsynced: the file either holds the whole identity or does not exist."""
    cdir.mkdir(parents=True, exist_ok=True)
    tmp = cdir / f".{RUN_ID_FILE}.{os.getpid()}.tmp"
    with tmp.open("w") as f:
        f.write(run_id + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, cdir / RUN_ID_FILE)
    fd = os.open(cdir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


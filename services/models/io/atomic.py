"""Write a model directory atomically: build in a temp dir next to the target, fsync, rename.

Concurrent builders and crashes never leave a half-written model at the target path: readers see
either nothing or a complete directory. When the target appears while we build (another process
won the race), the existing directory is kept and ours is discarded.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Written last into every directory we build; its presence marks a complete model directory.
MARKER = "rlfleet_model.json"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def read_model_info(path: Path) -> dict[str, Any] | None:
    """The marker of a directory we built, or None for a foreign model directory."""
    marker = Path(path) / MARKER
    if not marker.is_file():
        return None
    data: dict[str, Any] = json.loads(marker.read_text())
    return data


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not support fsync on directories
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def staging_dir(target: Path) -> Iterator[Path]:
    """Yield a fresh temp dir beside `target`; on clean exit publish it as `target`.

    The caller writes everything into the yielded directory, `MARKER` last. If `target` exists (and
    is not an empty directory) by the time we publish, the existing one wins. The temp dir is
    removed on any failure.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        try:
            os.rename(tmp, target)  # atomic; replaces `target` only if it is an empty directory
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            log.info("%s appeared while building; keeping the existing one", target)
        else:
            _fsync_dir(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

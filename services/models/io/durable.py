"""Durable file-system steps: a write, a create or a rename that survives a crash once it returns.

Each helper fsyncs what it wrote (the file, or the directory entry), so a caller that renames into
place afterwards knows the bytes are on disk before the name is.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def json_bytes(doc: Any, indent: int | None = 1) -> bytes:
    return json.dumps(doc, indent=indent, sort_keys=True).encode()


def write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
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


def mkdir_durable(path: Path) -> None:
    """mkdir -p, with every new directory entry fsynced into its parent."""
    created: list[Path] = []
    p = path
    while not p.exists():
        created.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    for new in created:
        fsync_dir(new.parent)

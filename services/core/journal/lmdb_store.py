"""`LmdbStore`: the LMDB plumbing the controller's journal and the actor's outbox share.

One environment per directory and per process (LMDB allows one handle per process), transactions
run under a lock, a full map doubles up to `max_map_size` and the transaction re-runs from scratch,
a map another process grew is adopted, and a full filesystem is told apart from other failures and
raised as the store's "full" error with the free space in the message, nothing written. writemap
stays off: pages are written with pwrite, so a full disk is an error code, not SIGBUS on a mapped
page, and the map size is only address space (growing it costs no disk). A subclass names its error
types, sub-databases and what "full" means for it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import lmdb

T = TypeVar("T")
S = TypeVar("S", bound="LmdbStore")

# A short pwrite (the disk filled mid-write) reaches us as EIO: below this much free space we call
# it full rather than a failing device.
DISK_FULL_SLACK_BYTES = 1 << 20

log = logging.getLogger(__name__)



class StoreFull(Exception):  # noqa: N818 (a state, like the builtin's ... Full errors)
    """Base of every store's "full" error: nothing of the failed write landed, and the same call
    succeeds once space returns. Callers hold work and retry instead of failing."""


_OPEN_PATHS: set[str] = set()
_OPEN_PATHS_LOCK = threading.Lock()


class LmdbStore:
    kind: ClassVar[str]  # "journal", "outbox": how messages name the store
    error: ClassVar[type[Exception]]
    full_error: ClassVar[type[Exception]]
    db_names: ClassVar[tuple[bytes, ...]]
    schema_version: ClassVar[int]
    # What a "full" error promises and asks, after "<kind> <path> is full: <detail>; <free>.".
    full_advice: ClassVar[str]

    def __init__(self, path: Path, *, map_size: int, max_map_size: int, sync: bool, metasync: bool,
                 readonly: bool) -> None:
        self._path = path
        self._map_size = map_size
        self._max_map_size = max_map_size
        self._sync = sync
        self._metasync = metasync
        self._readonly = readonly
        self._lock = threading.RLock()
        self._env: Any = None
        self._dbs: dict[bytes, Any] = {}
        self._closed = False
        self._path_key = ""

    @classmethod
    def _open_store(cls: type[S], path: str | os.PathLike[str], map_size: int, max_map_size: int,
                    readonly: bool, make: Callable[[Path, int, int], S]) -> S:
        """Create the directory, size the map, register the path, open the environment, check the
        schema and clear reader slots of dead processes; `make(path, map_size, max_map_size)`
        builds the instance."""
        if map_size <= 0 or max_map_size < map_size:
            raise ValueError(f"need 0 < map_size <= max_map_size, got {map_size} and {max_map_size}")
        p = Path(path).absolute()
        try:
            if not readonly:
                p.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise cls.full_error(f"{cls.kind} {p} cannot be created: filesystem full ({err})") from err
            raise
        data = p / "data.mdb"
        if data.exists():
            # Reopen at least at the size the file already has: a restart does not replay every
            # doubling it went through before.
            map_size = max(map_size, data.stat().st_size)
            max_map_size = max(max_map_size, map_size)
        key = str(p.resolve()) if p.exists() else str(p)
        with _OPEN_PATHS_LOCK:
            if key in _OPEN_PATHS:
                raise cls.error(f"{cls.kind} {p} is already open in this process (LMDB allows one handle per process)")
            _OPEN_PATHS.add(key)
        store = make(p, map_size, max_map_size)
        store._path_key = key
        try:
            store._open_env()
            store._check_schema()
            store.reader_check()
        except BaseException:
            store.close()
            raise
        return store

    def _open_env(self) -> None:
        try:
            env = lmdb.open(
                str(self._path),
                map_size=self._map_size,
                max_dbs=len(self.db_names) + 2,
                subdir=True,
                readonly=self._readonly,
                create=not self._readonly,
                sync=self._sync,
                metasync=self._metasync,
                writemap=False,  # see the module docstring
                # Random access to small records; OS readahead would only pollute the page cache.
                readahead=False,
                lock=True,
            )
        except lmdb.Error as err:
            if self._is_disk_full(err):
                raise self._full(f"cannot open: {err}") from err
            raise self.error(f"cannot open {self.kind} {self._path}: {err}") from err
        try:
            self._dbs = {name: env.open_db(name, create=not self._readonly) for name in self.db_names}
        except lmdb.Error as err:
            env.close()
            raise self.error(f"{self.kind} {self._path} is missing a sub-database: {err}") from err
        self._env = env
        self._map_size = env.info()["map_size"]

    def _check_schema(self) -> None:
        def fn(txn: Any) -> None:
            meta = self._dbs[b"meta"]
            raw = txn.get(b"schema", db=meta)
            if raw is None and not self._readonly:
                txn.put(b"schema", str(self.schema_version).encode(), db=meta)
            elif raw is not None and int(raw) != self.schema_version:
                raise self.error(
                    f"{self.kind} {self._path} has schema {int(raw)}, this code reads {self.schema_version}")

        if self._readonly:
            self._read(fn)
        else:
            self._write(fn)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._env is not None:
                self._env.close()
                self._env = None
            with _OPEN_PATHS_LOCK:
                _OPEN_PATHS.discard(self._path_key)

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> Path:
        return self._path

    @property
    def map_size(self) -> int:
        return self._map_size

    def reader_check(self) -> int:
        """Clear reader slots of dead processes; returns how many. A stale slot pins the
        snapshot it was reading, so LMDB cannot reuse freed pages and the file only grows."""
        with self._lock:
            return int(self._require_env().reader_check())

    def disk_free_bytes(self) -> int:
        """Bytes available on the store's filesystem. f_bavail, not f_bfree: the space an
        unprivileged writer gets."""
        st = os.statvfs(self._path)
        return st.f_bavail * st.f_frsize

    # -- transaction plumbing ----------------------------------------------------------------

    def _require_env(self) -> Any:
        if self._closed:
            raise self.error(f"{self.kind} {self._path} is closed")
        if self._env is None:
            self._open_env()  # a disk error closed it (see _heal); reopen now
        return self._env

    def _write(self, fn: Callable[[Any], T]) -> T:
        """Run `fn` in one write transaction; commit on return, abort on any exception.

        A full map is grown and `fn` re-run from scratch, so `fn` must derive everything from the
        transaction and have no outside side effects."""
        if self._readonly:
            raise self.error(f"{self.kind} {self._path} is open read-only")
        with self._lock:
            while True:
                env = self._require_env()
                try:
                    with env.begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self._grow()
                except lmdb.MapResizedError:
                    env.set_mapsize(0)  # another process grew it; adopt its size and retry
                    self._map_size = env.info()["map_size"]
                except (lmdb.Error, OSError) as err:
                    if self._is_disk_full(err):
                        self._heal()
                        raise self._full(f"the disk filled up during a commit (LMDB: {err})") from err
                    raise self.error(f"{self.kind} {self._path}: {err}") from err

    def _read(self, fn: Callable[[Any], T]) -> T:
        with self._lock:
            for _ in range(2):
                env = self._require_env()
                try:
                    with env.begin(write=False) as txn:
                        return fn(txn)
                except lmdb.MapResizedError:
                    env.set_mapsize(0)
                    self._map_size = env.info()["map_size"]
            raise self.error(f"{self.kind} {self._path}: map keeps being resized by another process")

    def _grow(self) -> None:
        if self._map_size >= self._max_map_size:
            raise self._full(f"map size {self._map_size} bytes reached max_map_size {self._max_map_size}")
        # Safe: no transaction of this process is open (we hold the lock, the failed one aborted).
        self._env.set_mapsize(min(self._map_size * 2, self._max_map_size))
        self._map_size = self._env.info()["map_size"]
        log.info("lmdb map grown", extra={"store": self.kind, "map_size": self._map_size})

    def _is_disk_full(self, err: BaseException) -> bool:
        if isinstance(err, OSError):
            return err.errno in (errno.ENOSPC, errno.EDQUOT)
        msg = str(err)
        if os.strerror(errno.ENOSPC) in msg or os.strerror(errno.EDQUOT) in msg:
            return True
        # LMDB turns a short pwrite into EIO (or a DiskError): tell a full disk apart from a
        # failing device by the space left.
        if isinstance(err, lmdb.DiskError) or os.strerror(errno.EIO) in msg:
            try:
                return self.disk_free_bytes() < DISK_FULL_SLACK_BYTES
            except OSError:
                return False
        return False

    def _full(self, detail: str) -> Exception:
        try:
            free = f"{self.disk_free_bytes()} bytes free"
        except OSError as err:
            free = f"free space unknown ({err})"
        return self.full_error(f"{self.kind} {self._path} is full: {detail}; {free} on its filesystem. "
                               f"{self.full_advice}")

    def _heal(self) -> None:
        """After a failed commit LMDB normally just aborts the transaction. If the failure hit the
        meta page it marks the environment fatal; the only cure is to reopen it, which rereads the
        newest meta page that fully reached disk."""
        try:
            with self._env.begin(write=False):
                pass
        except lmdb.Error:
            try:
                self._env.close()
            finally:
                self._env = None  # _require_env reopens on the next call

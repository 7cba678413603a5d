"""The TCP ports a fleet binds: distinct, free, claimed host-wide, and checked before anything starts.

A port the config leaves at 0 is picked here rather than by each service, because every service
must know every other's port before any of them starts. Two launchers on one host would otherwise
race between "this port is free" and the service binding it, so each pick is recorded in a claims
file (one per user, under the temp directory) until the launcher that made it exits; a launcher
never picks a port another live launcher has claimed. Fixed ports (non-zero in the config) are
used as given, and checked: a port that is in use is an error naming the service, the port and,
where /proc tells, the process that holds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["PortClaims", "PortError", "PortRequest", "assign_ports", "c10d_store", "check_free", "port_holder"]


class PortError(RuntimeError):
    """A port that cannot be used; the message names the service, the port and what holds it."""


@dataclass(frozen=True)
class PortRequest:
    """One port a fleet needs: `name` is what the user sees ("critic http_port", "redis")."""

    name: str
    host: str
    port: int = 0  # 0: pick a free one
    field: str | None = None  # the config field that fixes it ("services.critic.http_port")


def _claims_path() -> Path:
    # Per user: another user's launcher cannot write here, and its ports are caught by the bind probe.
    return Path(tempfile.gettempdir()) / f"rlfleet-ports-{os.getuid()}.json"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs; a zombie (exited, not yet reaped) is gone for our purposes."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


class PortClaims:
    """The host-wide record of ports picked by live launchers: {port: {pid, owner}}."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or _claims_path()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, dict[str, object]]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    raw = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    raw = {}
                claims = {k: v for k, v in raw.items()
                          if isinstance(v, dict) and isinstance(v.get("pid"), int) and pid_alive(v["pid"])}
                yield claims
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(claims))
                tmp.replace(self.path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def held(self) -> dict[int, str]:
        """Every port claimed by a live launcher -> who claimed it."""
        with self._locked() as claims:
            return {int(p): str(c.get("owner", "")) for p, c in claims.items()}

    def claim(self, ports: Mapping[int, str], pick: Sequence[PortRequest], owner: str) -> dict[str, int]:
        """Record `ports` (fixed ones, port -> name) and pick a distinct free port for each of `pick`,
        all under one lock so a concurrent launcher sees them. Returns name -> picked port. `owner`
        names the claimant (several fleets may run in one process, as in the tests)."""
        with self._locked() as claims:
            others = {int(p): str(c.get("owner", "")) for p, c in claims.items() if not _mine(c, owner)}
            for port, name in ports.items():
                if port in others:
                    raise PortError(f"{name} {port} is claimed by another rlfleet launcher ({others[port]}):"
                                    " stop that fleet or pick another port (0 picks a free one)")
            taken = set(others) | set(ports)
            picked: dict[str, int] = {}
            for req in pick:
                port = _free_port(req.host, taken)
                picked[req.name] = port
                taken.add(port)
            for p in [p for p, c in claims.items() if _mine(c, owner)]:
                del claims[p]  # a launcher preparing again (a resumed run) replaces its own claims
            for port in [*ports, *picked.values()]:
                claims[str(port)] = {"pid": os.getpid(), "owner": owner}
        return picked

    def release(self, owner: str) -> None:
        """Drop `owner`'s claims (its fleet stopped)."""
        with self._locked() as claims:
            for p in [p for p, c in claims.items() if _mine(c, owner)]:
                del claims[p]


def _mine(claim: Mapping[str, object], owner: str) -> bool:
    return claim.get("pid") == os.getpid() and claim.get("owner") == owner


def _free_port(host: str, avoid: set[int]) -> int:
    """A port the kernel says is free on `host`, not in `avoid`. Sockets stay open until one is
    found so the kernel never hands out the same port twice in one search."""
    held: list[socket.socket] = []
    try:
        for _ in range(64):
            s = socket.socket(_family(host), socket.SOCK_STREAM)
            held.append(s)
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in avoid:
                return port
        raise PortError(f"no free TCP port on {host} after 64 tries")
    finally:
        for s in held:
            s.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def is_free(host: str, port: int) -> bool:
    """Whether a service could bind `port` now (with SO_REUSEADDR, as the services bind)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise PortError(f"cannot bind {host}:{port}: {err.strerror}") from None
    return True


def _socket_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] in ("0A", "07"):
                inodes.add(cols[9])  # 0A: listening, 07: bound, not yet listening
    return inodes - {"0"}


def port_holder(port: int) -> str:
    """Who holds `port`: "pid N (command)" from /proc, a live launcher's claim, or "another process"."""
    inodes = _socket_inodes(port)
    if inodes:
        wanted = {f"socket:[{i}]" for i in inodes}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                for fd in (proc / "fd").iterdir():
                    if os.readlink(fd) in wanted:
                        cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                        return f"pid {proc.name} ({cmd[:120] or '?'})"
            except OSError:
                continue
    owner = PortClaims().held().get(port)
    if owner:
        return f"another rlfleet launcher ({owner})"
    return "another process (not visible to this user)"


def check_free(requests: Sequence[PortRequest]) -> None:
    """Every port must be free now; the first that is not is an error naming it and its holder."""
    for req in requests:
        if not is_free(req.host, req.port):
            fix = f"stop it or set {req.field} to another port (0 picks a free one)" if req.field else "stop it"
            raise PortError(f"{req.name} {req.host}:{req.port} is in use by {port_holder(req.port)}: {fix}")


def assign_ports(requests: Sequence[PortRequest], owner: str, *, check: bool = True,
                 claims: PortClaims | None = None) -> dict[str, int]:
    """name -> port for every request: fixed ports as given (each used once), free distinct ports for
    the rest, claimed for this process until `PortClaims.release` or its exit; then (`check`) every
    one must be free now."""
    fixed: dict[tuple[str, int], str] = {}
    for req in requests:
        if req.port:
            other = fixed.get((req.host, req.port))
            if other is not None:
                raise PortError(f"{other} and {req.name} are both set to {req.host}:{req.port}:"
                                " give each service its own port (0 picks a free one)")
            fixed[(req.host, req.port)] = req.name
    picked = (claims or PortClaims()).claim({port: name for (_, port), name in fixed.items()},
                                            [r for r in requests if not r.port], owner)
    out = {r.name: r.port or picked[r.name] for r in requests}
    if check:
        check_free([PortRequest(r.name, r.host, out[r.name], r.field) for r in requests])
    return out


def c10d_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A torch.distributed TCPStore server listening on `host` only ("" for every interface): c10d
    binds every interface itself, so the socket is bound here and handed over. Raises OSError."""
    import torch.distributed as dist

    sk = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sk.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted leader rebinds at once
    try:
        sk.bind((host, port))
        sk.listen(512)
    except OSError:
        sk.close()
        raise
    bound = sk.getsockname()[1]
    return dist.TCPStore("127.0.0.1", bound, None, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sk.detach(), use_libuv=True)

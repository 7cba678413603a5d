"""Start and stop a private `redis-server`: used by `rlfleet up` when no Redis URL is configured,
and by the tests, which always talk to a real server on a free loopback port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from services.core.host import lifeline


class RedisNotFound(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class RedisProcess:
    proc: subprocess.Popen[bytes]
    port: int
    dir: Path
    host: str = "127.0.0.1"
    password: str | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is not None:
            self._close_pipes()
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            self.proc.stderr.close()


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RedisNotFound(
            "redis-server not found on PATH: install it (Debian: apt-get install redis-server; `make setup`"
            " does this) or set redis.url in the config"
        )
    return path


def start_redis(
    data_dir: Path,
    port: int | None = None,
    host: str = "127.0.0.1",
    password: str | None = None,
    appendfsync: str = "everysec",
    timeout_s: float = 10.0,
    log_name: str = "redis.log",
    die_with_parent: bool = False,
) -> RedisProcess:
    """Start redis-server with AOF on and noeviction, as docs/architecture.md requires, and wait for PING.
    `die_with_parent`: the server gets SIGTERM when this process dies, even by SIGKILL (on Linux, when
    called from the main thread: the signal follows the thread that started the server)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    args = [redis_server_binary()]
    if password:
        # Through a 0600 config file, not the command line, where `ps` would show it to everyone.
        conf = data_dir / "auth.conf"
        conf.touch(mode=0o600)
        conf.chmod(0o600)
        conf.write_text(f"requirepass {password}\n")
        args.append(str(conf))
    args += [
        "--bind", host,
        "--port", str(port),
        "--dir", str(data_dir),
        "--appendonly", "yes",
        "--appendfsync", appendfsync,
        "--save", "",
        "--maxmemory-policy", "noeviction",
        "--protected-mode", "yes" if password is None and host not in ("127.0.0.1", "::1") else "no",
        "--logfile", str(data_dir / log_name),
    ]
    if die_with_parent and threading.current_thread() is threading.main_thread():
        args = lifeline.wrap_command(args)
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rp = RedisProcess(proc=proc, port=port, dir=data_dir, host=host, password=password)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"redis-server exited with code {proc.returncode} on port {port}: {err.strip()}")
        try:
            if rp.client().ping():
                return rp
        except redis.exceptions.ConnectionError:
            pass
        if time.monotonic() > deadline:
            rp.stop(kill=True)
            raise TimeoutError(f"redis-server on port {port} did not answer PING within {timeout_s}s")
        time.sleep(0.02)

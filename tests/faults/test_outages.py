"""Outages of what the fleet stands on, against a real fleet on the tiny task: Redis gone while a
service restarts, and the disk under the run directory filling up. Each case ends with the run
completing every step with no service restarted beyond the one the test killed, and
`rlfleet audit` passing."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from services.core.config.run import RunConfig
from services.core.host.redis_proc import start_redis
from tests.faults.test_faults import Run, fault_config

pytestmark = pytest.mark.slow

# How long Redis stays down once the replacement controller is up: a controller that exits when
# Redis is down (a start takes ~2 s here: it imports neither torch nor transformers) is restarted
# again within it, which the outage's own check catches; a waiting one rides it out (services wait
# up to bus.STARTUP_WAIT_S).
REDIS_DOWN_S = 10.0


@pytest.fixture
def run_factory(fleet_factory: Any) -> Iterator[Callable[[RunConfig], Run]]:
    def make(cfg: RunConfig) -> Run:
        return Run(fleet_factory(cfg, restart_budget=3), cfg)

    yield make


def test_a_controller_restarted_while_redis_is_down_waits_for_it(
    tmp_path: Path, tiny_model: Path, run_factory: Callable[[RunConfig], Run]
) -> None:
    cfg = fault_config(tmp_path / "run", tiny_model)
    run = run_factory(cfg)
    fleet = run.fleet

    def outage() -> None:
        rp = fleet.redis
        assert rp is not None
        log = cfg.run_dir / "logs" / "controller.log"
        rp.stop(kill=True)
        seen = log.stat().st_size
        os.kill(fleet.procs["controller"].proc.pid, signal.SIGKILL)
        # Redis stays down until the replacement is up (a slow start under load must not let it
        # miss the outage), then REDIS_DOWN_S longer; it must wait, not die and be restarted.
        waiting, waiting_since = f"waiting for Redis at 127.0.0.1:{rp.port}".encode(), None
        deadline = time.monotonic() + 240
        while waiting_since is None or time.monotonic() - waiting_since < REDIS_DOWN_S:
            ctl = fleet.procs["controller"]
            assert ctl.restarts <= 1, f"the controller was restarted {ctl.restarts} times while Redis was down"
            assert time.monotonic() < deadline, "the replacement controller never started waiting for Redis"
            if waiting_since is None and waiting in log.read_bytes()[seen:]:
                waiting_since = time.monotonic()
            time.sleep(0.5)
        fleet.redis = start_redis(rp.dir, port=rp.port)  # same AOF: Redis comes back with its data

    run.fault(f"controller kill -9 with Redis down {REDIS_DOWN_S:.0f} s", outage)
    run.finish()
    restarts = {n: sp.restarts for n, sp in fleet.procs.items() if sp.restarts}
    assert restarts == {"controller": 1}, f"expected only the killed controller to restart: {restarts}"


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `path`; its logs are copied next to it before it goes away."""
    path.mkdir(parents=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            shutil.copytree(path / "logs", path.with_name(f"{path.name}-logs"))
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> None:
    """Take every free byte of `path`'s filesystem (down to the page the filesystem allocates),
    at once: a tiny run's step takes a fraction of a second."""
    st = os.statvfs(path.parent)
    with path.open("ab", buffering=0) as f:
        with contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, max(1, st.f_bavail * st.f_frsize - (1 << 20)))
        f.seek(0, os.SEEK_END)
        for chunk in (1 << 20, 64 << 10, 4 << 10, 512):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\x00" * chunk)


def test_a_full_disk_under_the_run_dir_holds_the_fleet_until_space_returns(
    tmp_path: Path, tiny_model: Path, run_factory: Callable[[RunConfig], Run]
) -> None:
    """Everything the run writes lives on one small filesystem: Redis's AOF, the journal, events,
    metrics, logs, checkpoints, the outbox. Filling it makes Redis refuse writes (MISCONF) and every
    other write fail with ENOSPC; the fleet must hold, report not ready and resume."""
    with small_filesystem(tmp_path / "run", "96m") as run_dir:
        # Enough steps that the run is still going when the disk fills (steps take ~0.3 s here).
        cfg = fault_config(run_dir, tiny_model, run={"max_steps": 30}, journal={"min_free_bytes": 512 * 1024})
        run = run_factory(cfg)
        fleet = run.fleet
        assert fleet.cfg is not None and fleet.redis is not None
        port = fleet.cfg.endpoint("controller").http_port
        filler = run_dir / "filler"

        def disk_full_then_freed() -> None:
            fill(filler)
            rc = redis.Redis(host=fleet.redis.host, port=fleet.redis.port)  # type: ignore[union-attr]
            deadline = time.monotonic() + 60
            misconf = ready = False
            while time.monotonic() < deadline and not (misconf and not ready):
                with contextlib.suppress(redis.ResponseError):
                    rc.xadd("probe", {"x": "1"})  # a write: refused once Redis fails to append its AOF
                    fill(filler.with_name(f"filler-{time.monotonic_ns()}"))  # it took the last bytes
                    continue
                misconf = rc.info("persistence").get("aof_last_write_status") == "err"
                dead = {n: sp.proc.returncode for n, sp in fleet.procs.items() if not sp.alive}
                assert not dead, f"services exited on a full disk: {dead}"
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
                time.sleep(0.2)
            assert misconf, "Redis never failed to write its AOF: the disk was not full"
            assert not ready, "the controller stayed ready on a full disk"
            time.sleep(8.0)  # hold the outage for a while: nothing may crash meanwhile
            dead = {n: sp.proc.returncode for n, sp in fleet.procs.items() if not sp.alive}
            assert not dead, f"services exited on a full disk: {dead}"
            for f in run_dir.glob("filler*"):
                f.unlink()

        run.fault("full disk under the run dir (Redis MISCONF, ENOSPC)", disk_full_then_freed)
        run.finish()
        restarts = {n: sp.restarts for n, sp in fleet.procs.items() if sp.restarts}
        assert not restarts, f"services restarted on a full disk instead of holding: {restarts}"

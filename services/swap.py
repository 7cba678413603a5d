"""`rlfleet swap`: hot-swap one service of a running local fleet (drain, the supervisor's replacement,
ready) while the run goes on, through the state files the services keep in RUN_DIR/services."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from services.core.host.ports import pid_alive
from services.fleet import FleetError, read_service_files


def swap(run_dir: Path, service: str, token: str | None = None, timeout_s: float = 180.0) -> dict[str, float]:
    """Hot-swap one service of a running local fleet: drain it (it finishes in-flight work,
    checkpoints and exits 0), let the supervisor start its replacement, and wait until the new
    process reports ready. Returns the timings."""
    files = read_service_files(run_dir)
    if service not in files:
        raise FleetError(f"no running service {service!r} in {run_dir / 'services'} (found: {', '.join(files)})")
    info = files[service]
    old_pid = int(info["pid"])
    if not pid_alive(old_pid):
        raise FleetError(f"{service} is not running (pid {old_pid} in {run_dir / 'services' / service}.json has"
                         " exited): start the run with `rlfleet up` first")
    base = f"http://{info['host']}:{info['http_port']}"
    headers = {"authorization": f"Bearer {token}"} if token else {}
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{base}/v1/drain", headers=headers, timeout=5.0)
    except httpx.HTTPError as err:
        raise FleetError(f"cannot reach {service} at {base} ({type(err).__name__}): is the fleet running?") from None
    if r.status_code >= 300:
        raise FleetError(f"{service} refused to drain: HTTP {r.status_code} {r.text[:200]}")
    deadline = t0 + timeout_s
    while pid_alive(old_pid):
        if time.monotonic() > deadline:
            raise FleetError(f"{service} (pid {old_pid}) did not exit within {timeout_s:.0f}s of drain")
        time.sleep(0.1)
    t_exit = time.monotonic()
    while True:
        new = read_service_files(run_dir).get(service, {})
        if new.get("pid") not in (None, old_pid) and new.get("state") == "ready":
            try:
                if httpx.get(f"http://{new['host']}:{new['http_port']}/readyz", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise FleetError(f"no ready replacement for {service} within {timeout_s:.0f}s")
        time.sleep(0.2)
    t_ready = time.monotonic()
    return {"drain_s": t_exit - t0, "replacement_ready_s": t_ready - t_exit, "total_s": t_ready - t0,
            "old_pid": float(old_pid), "new_pid": float(new["pid"])}

"""A whole fleet's start on this host, with and without the zygote (`services.prefork`): seconds from
`Fleet.start` to each service's first 200 on /readyz, then from SIGKILL of each forked service to its
replacement's (as the supervisor restarts it), then `Fleet.stop` (SIGTERM, every service's drain and
exit, Redis).

    python -m bench.fleet_start [--config FILE] [--repeat 3] [--modes zygote,popen] [--json OUT]

The tiny model is built once; each repeat starts a fresh fleet in a new run directory, the modes
alternating (zygote, popen, zygote, ...) so that a change in the host's load falls on both. Medians
are printed with the load average: unlike `bench.startup` (each service alone), the services here
compete for the cores as they do in `rlfleet up` and in the fleet tests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from services.core.config.run import load_config, parse_config
from services.fleet import Fleet
from services.prefork import ENV, FORKED

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "services" / "examples" / "tiny-cpu.yaml"
READY_TIMEOUT_S = 180.0


def _ready(fleet: Fleet, name: str) -> bool:
    try:
        return fleet.http(name, "/readyz", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def one_start(data: dict[str, Any], run_dir: Path, mode: str) -> dict[str, Any]:
    """Start a fleet of `data` in `run_dir` with the zygote on or off; the seconds each service took."""
    os.environ[ENV] = "1" if mode == "zygote" else "0"
    d = json.loads(json.dumps(data))
    d["run"].update(dir=str(run_dir), max_steps=100000, eval_every=0)  # still starting when measured
    fleet = Fleet(parse_config(d, source="bench"))
    ready: dict[str, float] = {}
    restart: dict[str, float] = {}
    failed: list[BaseException] = []

    def start() -> None:
        try:
            fleet.start(ready_timeout_s=READY_TIMEOUT_S)
        except BaseException as err:  # reported below, from the main thread
            failed.append(err)

    stop_s: float | None = None
    t0 = time.monotonic()
    th = threading.Thread(target=start, daemon=True)
    th.start()
    try:
        needed = set(fleet.base_cfg.services_needed())
        while not needed <= set(ready) and not failed:
            for name in [n for n in list(fleet.procs) if n not in ready]:
                if _ready(fleet, name):
                    ready[name] = round(time.monotonic() - t0, 2)
            time.sleep(0.02)
        th.join()
        if failed:
            raise failed[0]
        for name in [n for n in FORKED if n in fleet.procs]:
            sp = fleet.procs[name]
            t1 = time.monotonic()
            os.killpg(sp.proc.pid, signal.SIGKILL)
            sp.proc.wait(timeout=30)
            fleet._launch(name, sp.name, restarts=1)  # what supervise does for a dead service
            while not _ready(fleet, name):
                if time.monotonic() - t1 > READY_TIMEOUT_S:
                    raise RuntimeError(f"{name} not ready again within {READY_TIMEOUT_S:.0f}s")
                time.sleep(0.02)
            restart[name] = round(time.monotonic() - t1, 2)
        t2 = time.monotonic()
        fleet.stop(grace_s=10)
        stop_s = round(time.monotonic() - t2, 2)
    finally:
        if stop_s is None:
            fleet.stop(grace_s=10)
    return {"mode": mode, "ready": ready, "all_ready": max(ready.values()), "restart": restart, "stop_s": stop_s,
            "load1": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_start", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--repeat", type=int, default=3, help="fleet starts per mode")
    p.add_argument("--modes", default="zygote,popen", help="comma-separated: zygote, popen")
    p.add_argument("--json", type=Path, default=None, help="also write every start to this file")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    assert set(modes) <= {"zygote", "popen"}, modes

    root = Path(tempfile.mkdtemp(prefix="rlfleet-fleet-start-"))
    data = yaml.safe_load(args.config.read_text())
    data.setdefault("run", {}).update(dir=str(root / "prepare"), trackers=[])
    for name in ("controller", "actor", "critic", "reward", "reference"):
        data.setdefault("services", {}).setdefault(name, {}).update(grpc_port=0, http_port=0)
    (root / "prepare.yaml").write_text(yaml.safe_dump(data))
    # The model once, outside the figures: each fleet then loads it by path, as the tests' fleets do.
    from services.models.roles.paths import resolve_model_path
    from services.tasks import load_task

    base = load_config(root / "prepare.yaml")
    spec = base.models.policy.model_copy(update={"path": str(root / "policy")})
    data["models"]["policy"] = {"path": str(resolve_model_path(spec, "policy", load_task(base.task), root,
                                                               base.run.seed))}
    rows = [one_start(data, root / f"run-{i}-{mode}", mode) for i in range(args.repeat) for mode in modes]
    print(f"fleet start on {os.cpu_count()} cores, median of {args.repeat} (load average at the end of each:"
          f" {', '.join(str(r['load1']) for r in rows)}):")
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        med = {n: statistics.median(r["ready"][n] for r in mine) for n in mine[0]["ready"]}
        again = {n: statistics.median(r["restart"][n] for r in mine) for n in mine[0]["restart"]}
        print(f"  {mode:<7} all ready {statistics.median(r['all_ready'] for r in mine):6.2f} s  ("
              + ", ".join(f"{n} {s:.2f}" for n, s in sorted(med.items(), key=lambda kv: kv[1])) + ")"
              + ("  restart after kill -9: " + ", ".join(f"{n} {s:.2f} s" for n, s in again.items()) if again else "")
              + f"  stop {statistics.median(r['stop_s'] for r in mine):.2f} s"
              f" ({min(r['stop_s'] for r in mine):.2f}-{max(r['stop_s'] for r in mine):.2f})")
    if args.json is not None:
        args.json.write_text(json.dumps({"cores": os.cpu_count(), "starts": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Start-up of each service on this host: how long `python -m services.<name>` takes from exec to a
200 on /readyz, and how long importing its server module takes in a fresh interpreter (with which
heavy packages that import loads).

One run prepares the run config's fleet once (a private redis-server, the tiny model built if the
config builds one), then starts each service alone, several times, against that Redis:

    python -m bench.startup [--config FILE] [--repeat 3] [--services controller,reward] [--json OUT]

Medians are printed. Each service runs alone, so the figures are its own start-up, not a fleet
competing for the cores; the host's load average is printed with them (numbers from a busy host
are not comparable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from services.core.config.run import RunConfig, load_config
from services.fleet import Fleet
from services.prefork import ENV

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "services" / "examples" / "tiny-cpu.yaml"
HEAVY = ("torch", "transformers", "numpy", "tokenizers")
READY_TIMEOUT_S = 120.0


def import_seconds(module: str) -> tuple[float, list[str]]:
    """Seconds to import `module` in a fresh interpreter, and the heavy packages it loaded."""
    code = (f"import sys, time, json\nt = time.perf_counter()\nimport {module}\n"
            f"print(json.dumps([time.perf_counter() - t, [p for p in {list(HEAVY)!r} if p in sys.modules]]))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       check=True)
    took, loaded = json.loads(p.stdout.strip().splitlines()[-1])
    return float(took), list(loaded)


def ready_seconds(fleet: Fleet, cfg: RunConfig, name: str) -> float:
    """Seconds from starting service `name` alone to its first 200 on /readyz; it is stopped after."""
    ep = cfg.endpoint(name)  # type: ignore[arg-type]
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", f"services.{name}", "--config", str(fleet.config_path)],
                            cwd=ROOT, env=fleet.service_env(name),  # type: ignore[arg-type]
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} before it was ready"
                                   f" (log: {fleet.run_dir / 'logs'})")
            try:
                if httpx.get(f"http://{ep.host}:{ep.http_port}/readyz", timeout=1.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                raise RuntimeError(f"{name} not ready within {READY_TIMEOUT_S:.0f}s")
            time.sleep(0.02)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--run-dir", type=Path, default=None, help="default: a fresh temporary directory")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--services", default="", help="comma-separated; default: every service the config needs")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = p.parse_args(argv)

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="rlfleet-startup-")) / "run"
    data = yaml.safe_load(args.config.read_text())
    data.setdefault("run", {}).update(dir=str(run_dir), trackers=[])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir.parent / "startup.yaml").write_text(yaml.safe_dump(data))
    base = load_config(run_dir.parent / "startup.yaml")
    names = [n for n in args.services.split(",") if n] or list(base.services_needed())
    # Each service is started here with Popen, alone: a zygote importing beside it would only skew the
    # figures (bench.fleet_start measures the fleet with and without one).
    os.environ[ENV] = "0"
    fleet = Fleet(base)
    rows: dict[str, dict[str, Any]] = {}
    try:
        cfg = fleet.prepare()  # Redis, the model, RUN_DIR/fleet.yaml: once, outside the figures
        for name in names:
            imports = [import_seconds(f"services.{name}.server") for _ in range(args.repeat)]
            ready = [ready_seconds(fleet, cfg, name) for _ in range(args.repeat)]
            rows[name] = {"ready_s": statistics.median(ready), "import_s": statistics.median(t for t, _ in imports),
                          "loads": imports[-1][1], "ready_samples": ready}
    finally:
        fleet.stop(grace_s=10)
    load1 = os.getloadavg()[0]
    print(f"start-up on {os.cpu_count()} cores (load average {load1:.2f}), median of {args.repeat}:")
    print(f"{'service':<11} {'ready s':>8} {'import s':>9}  heavy packages its server module loads")
    for name, row in rows.items():
        print(f"{name:<11} {row['ready_s']:>8.2f} {row['import_s']:>9.2f}  {', '.join(row['loads']) or '-'}")
    if args.json is not None:
        args.json.write_text(json.dumps({"cores": os.cpu_count(), "load1": load1, "services": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What `rlfleet up` does before its services start: the seconds a user waits for the first step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PREPARE = """
import json, sys
from services.core.config.run import parse_config
from services.fleet import Fleet
fleet = Fleet(parse_config(json.loads(sys.argv[1]), source="test"))
try:
    fleet.prepare()
    print(json.dumps({"torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules,
                      "redis": fleet.redis is not None and fleet.redis.proc.poll() is None}))
finally:
    fleet.stop(grace_s=5)
"""


UP = """
import json, sys
import services.fleet
from services import cli

seen = {}

def start(self, ready_timeout_s=180.0):  # where `rlfleet up` launches its services: what it loaded by then
    seen.update(torch="torch" in sys.modules, transformers="transformers" in sys.modules,
                redis=self.redis is not None and self.redis.proc.poll() is None)

services.fleet.Fleet.start = start
services.fleet.Fleet.supervise = lambda self, *a, **k: 0
sys.argv = ["rlfleet", "up", "--config", sys.argv[1]]
try:
    cli.main()
finally:
    print(json.dumps(seen))
"""


def _prepare(cfg: dict[str, object]) -> dict[str, bool]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", PREPARE, json.dumps(cfg)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.slow
def test_a_policy_given_by_path_starts_redis_without_the_launcher_importing_torch(tmp_path: Path,
                                                                                  tiny_model: Path) -> None:
    # Seen on the H200: the launcher spent seconds (24 s on a loaded 2-core host) importing torch and
    # transformers' model code before it started Redis and any service, though a model given by path
    # needs no build.
    got = _prepare({"run": {"dir": str(tmp_path / "run")}, "models": {"policy": {"path": str(tiny_model)}}})
    assert got == {"torch": False, "transformers": False, "redis": True}
    recs = [json.loads(ln) for ln in (tmp_path / "run" / "logs" / "launcher.log").read_text().splitlines()
            ] if (tmp_path / "run" / "logs" / "launcher.log").exists() else []
    assert all(r.get("given_by_path", True) for r in recs if r["msg"] == "models prepared")


@pytest.mark.slow
def test_a_policy_to_build_is_built_by_the_launcher_before_any_service_starts(tmp_path: Path) -> None:
    got = _prepare({"run": {"dir": str(tmp_path / "run")}, "models": {"policy": {"build": {"warmup_steps": 0}}}})
    assert got["torch"] and got["redis"]
    assert (tmp_path / "run" / "models" / "policy" / "config.json").is_file()


@pytest.mark.slow
def test_rlfleet_up_starts_its_services_without_importing_torch_for_a_policy_given_by_path(
        tmp_path: Path, tiny_model: Path) -> None:
    # Seen on the H100 (2026-12-07): `rlfleet up` imported torch before starting Redis, 6 s between
    # its preflight and Redis on every start, all of it before the first optimizer step.
    import yaml

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"dir": str(tmp_path / "run")},
                                   "models": {"policy": {"path": str(tiny_model)}}}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", UP, str(cfg)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=180)
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"torch": False, "transformers": False, "redis": True}, p.stderr[-2000:]

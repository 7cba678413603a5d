"""Port assignment: distinct free ports, host-wide claims between launchers, checks that name the holder."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services.core.config.run import parse_config
from services.core.host.ports import PortClaims, PortError, PortRequest, assign_ports, check_free
from services.fleet import resolve_fleet_config

ROOT = Path(__file__).resolve().parents[2]

OTHER_LAUNCHER = """
import json, sys
from services.core.host.ports import PortClaims, PortRequest
picked = PortClaims().claim({}, [PortRequest(f"s{i}", "127.0.0.1") for i in range(8)], owner="other launcher")
print(json.dumps(sorted(picked.values())), flush=True)
sys.stdin.read()  # hold the claims until the test closes our stdin
"""


def test_every_service_of_a_default_config_gets_its_own_port(tmp_path: Path) -> None:
    cfg = parse_config({"run": {"dir": str(tmp_path)}, "algo": {"name": "ppo", "kl_coef": 0.1}})
    resolved = resolve_fleet_config(cfg, "redis://127.0.0.1:1/0")
    ports = [getattr(resolved.endpoint(n), k) for n in resolved.services_needed() for k in ("grpc_port", "http_port")]
    assert len(ports) == 10 and all(ports)
    assert len(set(ports)) == len(ports), ports


def test_fixed_ports_are_kept_and_never_picked_for_another_service() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        fixed = s.getsockname()[1]
    reqs = [PortRequest(f"svc{i}", "127.0.0.1") for i in range(12)] + [PortRequest("pinned", "127.0.0.1", fixed)]
    owner = f"test {os.getpid()} fixed"
    try:
        out = assign_ports(reqs, owner)
    finally:
        PortClaims().release(owner)
    assert out["pinned"] == fixed
    assert len(set(out.values())) == len(reqs)


def test_two_services_on_one_fixed_port_are_an_error_naming_both() -> None:
    reqs = [PortRequest("critic http_port", "127.0.0.1", 40123), PortRequest("reward http_port", "127.0.0.1", 40123)]
    with pytest.raises(PortError, match=r"critic http_port and reward http_port are both set to 127.0.0.1:40123"):
        assign_ports(reqs, "test duplicate")


def test_a_port_another_live_launcher_claimed_is_never_picked_and_cannot_be_fixed() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    other = subprocess.Popen([sys.executable, "-c", OTHER_LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    owner = f"test {os.getpid()} claims"
    try:
        theirs = set(json.loads(other.stdout.readline()))  # type: ignore[union-attr]
        assert len(theirs) == 8
        assert set(PortClaims().held()) >= theirs
        mine = assign_ports([PortRequest(f"s{i}", "127.0.0.1") for i in range(40)], owner)
        assert not set(mine.values()) & theirs
        taken = min(theirs)
        with pytest.raises(PortError, match=r"claimed by another rlfleet launcher \(other launcher\)"):
            assign_ports([PortRequest("reward http_port", "127.0.0.1", taken)], owner)
    finally:
        PortClaims().release(owner)
        other.communicate(input="", timeout=30)
    # Claims die with their launcher.
    assert not set(PortClaims().held()) & theirs


def test_a_port_in_use_is_refused_naming_the_field_and_the_holding_process() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortError) as err:
            check_free([PortRequest("actor grpc_port", "127.0.0.1", port, "services.actor.grpc_port")])
    msg = str(err.value)
    assert f"actor grpc_port 127.0.0.1:{port} is in use by pid {os.getpid()}" in msg
    assert "services.actor.grpc_port" in msg and "\n" not in msg

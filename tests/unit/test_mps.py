"""run.cuda_mps: the launcher's own MPS control daemon. `nvidia-cuda-mps-control` cannot run without
an NVIDIA driver, so a script of that name on PATH stands in for it and records how it was called."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from services.core.config.run import ConfigError, parse_config
from services.core.host.mps import CONTROL, MpsDaemon, MpsError


def _fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exit_code: int = 0) -> Path:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    script = bin_dir / CONTROL
    script.write_text("#!/bin/sh\n"
                      f'echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> {calls}\n'
                      f'[ {exit_code} -eq 0 ] || echo "An instance of this daemon is already running" >&2\n'
                      f"exit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_the_daemon_runs_in_a_directory_of_its_own_and_quits_with_the_fleet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_control(tmp_path, monkeypatch)
    daemon = MpsDaemon.start()
    pipe = daemon.env["CUDA_MPS_PIPE_DIRECTORY"]
    assert Path(pipe).is_dir() and len(pipe) < 64  # a socket path must stay short: not under the run dir
    assert daemon.env["CUDA_MPS_LOG_DIRECTORY"].startswith(str(daemon.root))
    daemon.stop()
    started, quit_ = calls.read_text().splitlines()
    assert started.startswith(f"args=-d pipe={pipe} ")
    assert quit_ == f"args= pipe={pipe} stdin=quit"
    assert not daemon.root.exists()


def test_a_daemon_that_cannot_start_is_one_line_naming_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_control(tmp_path, monkeypatch, exit_code=1)
    with pytest.raises(MpsError, match=rf"{CONTROL} -d failed \(exit 1\): An instance of this daemon is already"):
        MpsDaemon.start()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(MpsError, match=rf"run.cuda_mps: {CONTROL} is not on PATH .*set run.cuda_mps: false"):
        MpsDaemon.start()


def test_every_service_the_launcher_starts_is_a_client_of_its_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.fleet import Fleet

    _fake_control(tmp_path, monkeypatch)
    cfg = parse_config({"run": {"dir": str(tmp_path / "run"), "cuda_mps": True},
                        "services": {"actor": {"device": "cuda"}}})
    fleet = Fleet(cfg)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in fleet.service_env("actor")
    fleet.mps = MpsDaemon.start()
    try:
        for name in ("actor", "reference", "controller"):
            assert fleet.service_env(name)["CUDA_MPS_PIPE_DIRECTORY"] == fleet.mps.env["CUDA_MPS_PIPE_DIRECTORY"]
    finally:
        fleet.stop(grace_s=1.0)
    assert fleet.mps is None


def test_cuda_mps_without_a_cuda_service_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"run\.cuda_mps: no service runs on a CUDA device"):
        parse_config({"run": {"cuda_mps": True}})

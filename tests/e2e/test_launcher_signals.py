"""`rlfleet up` stopped from outside at any moment: by Ctrl-C while it starts, or by SIGKILL, which runs
none of its cleanup. Either way nothing of its fleet (services, their children, redis-server) may
outlive it by more than seconds, and a stray that does is named by the next `rlfleet up`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.core.host import lifeline
from tests.e2e.test_cli import RLFLEET, ROOT, assert_one_line_error, rlfleet, write_config
from tests.fleet_helpers import processes_of

ORPHANS_GONE_S = 15.0  # after SIGKILL of the launcher: every process of its fleet has exited


def _as_from_a_terminal() -> None:
    """Ctrl-C's disposition as a terminal's shell gives the launcher: a suite run as a background job
    (`make test &`, nohup) ignores SIGINT, and its children inherit that until the launcher installs its
    own handler, so a Ctrl-C in its first second would be lost where a user's is not."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _popen_up(cfg: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = dict(os.environ if env is None else env, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.Popen([*RLFLEET, "up", "--config", str(cfg)], cwd=ROOT, env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            preexec_fn=_as_from_a_terminal)


def _kill_all(entries: list[str]) -> None:
    """A failing test must not leave a fleet running for the next one."""
    for entry in entries:
        with contextlib.suppress(OSError):
            os.kill(int(entry.split()[0]), signal.SIGKILL)


def _gone_within(run_dir: Path, seconds: float) -> tuple[list[str], float]:
    t0 = time.monotonic()
    while (left := processes_of(run_dir)) and time.monotonic() - t0 < seconds:
        time.sleep(0.2)
    return left, time.monotonic() - t0


@pytest.mark.slow
def test_a_sigkilled_launcher_takes_its_services_and_redis_down_within_seconds(tmp_path: Path,
                                                                              tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", run_dir, models={"policy": {"path": str(tiny_model)}},
                       run={"max_steps": 1000, "eval_every": 0})
    proc = _popen_up(cfg)
    fleet: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            if line.startswith("all services ready") or time.monotonic() > deadline:
                break
        assert line.startswith("all services ready"), (line, proc.poll())
        fleet = processes_of(run_dir)
        names = " ".join(fleet)
        assert "redis-server" in names and "services.controller" in names and "services.reward" in names, fleet
        recorded = lifeline.holders(run_dir)  # what the next launcher would name, while they run
        assert {h.split()[0] for h in recorded} >= {"redis-server", "controller", "actor", "reward", "launcher"}
        proc.kill()
        proc.wait(timeout=10)
        left, took = _gone_within(run_dir, ORPHANS_GONE_S)
    finally:
        with contextlib.suppress(OSError):
            proc.kill()
        proc.communicate(timeout=10)
        _kill_all(processes_of(run_dir))
    assert left == [], f"still running {took:.1f}s after SIGKILL of rlfleet up: {left}"
    assert lifeline.holders(run_dir) == []


def test_a_stray_process_of_an_earlier_launcher_is_named_and_nothing_starts(tmp_path: Path,
                                                                             tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=run_dir)
    try:
        # Recorded by a process that is gone since, as a launcher killed by SIGKILL leaves it.
        code = ("import sys; from pathlib import Path; from services.core.host import lifeline;"
                " lifeline.record(Path(sys.argv[1]), 'reward', int(sys.argv[2]))")
        subprocess.run([sys.executable, "-c", code, str(run_dir), str(stray.pid)], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True, timeout=60)
        cfg = write_config(tmp_path / "c.yaml", run_dir, models={"policy": {"path": str(tiny_model)}})
        line = assert_one_line_error(rlfleet("up", "--config", str(cfg)), f"reward pid {stray.pid}",
                                     str(run_dir), f"kill {stray.pid}")
        assert "launcher" not in line  # the recording process is gone
        assert not (run_dir / "redis").exists()
    finally:
        stray.kill()
        stray.wait()
    # Once it is gone the directory is free: a pid reused by another process is not taken for it.
    assert lifeline.holders(run_dir) == []


INTERRUPT_EXITS_S = 10.0  # Ctrl-C at any moment of the start: the launcher and all it started are gone


def _redis_up(run_dir: Path) -> bool:  # the launcher then builds the model
    return (run_dir / "processes.json").exists()


def _first_service_up(run_dir: Path) -> bool:
    return any((run_dir / "services").glob("*.json"))


# Moments of a fresh start (no compiled module caches, a model to build): seconds after exec, or a
# condition on the run directory; the last one with the session's prebuilt model, past the build.
MOMENTS = {
    "after 0.5 s": 0.5,
    "after 2 s": 2.0,
    "after 5 s": 5.0,
    "when Redis is up, the model building": _redis_up,
    "when the first service is up": _first_service_up,
}


@pytest.mark.slow
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_at_any_moment_of_a_fresh_start_exits_within_10s_leaving_nothing(
        moment: str, tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    when = MOMENTS[moment]
    fresh = when is not _first_service_up
    models = {"policy": {"build": {"warmup_steps": 20}}} if fresh else {"policy": {"path": str(tiny_model)}}
    cfg = write_config(tmp_path / "c.yaml", run_dir, models=models, run={"max_steps": 1000, "eval_every": 0})
    # An empty cache prefix: every module compiles from source, as in a fresh clone.
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(tmp_path / "pycache")) if fresh else None
    t0 = time.monotonic()
    proc = _popen_up(cfg, env)
    try:
        while (time.monotonic() - t0 < when) if isinstance(when, float) else not when(run_dir):
            assert proc.poll() is None and time.monotonic() - t0 < 180, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        t_signal = time.monotonic()
        try:
            out, err = proc.communicate(timeout=INTERRUPT_EXITS_S + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        took = time.monotonic() - t_signal
        left = processes_of(run_dir)
    finally:
        with contextlib.suppress(OSError):
            proc.kill()
        _kill_all(processes_of(run_dir))
    assert took < INTERRUPT_EXITS_S, f"rlfleet up exited {took:.1f}s after SIGINT {moment}: {err[-1500:]}"
    assert left == [], f"left running after SIGINT {moment}: {left}"
    assert proc.returncode == 130, (proc.returncode, out[-1000:], err[-1500:])
    assert "Traceback" not in out + err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted"), err

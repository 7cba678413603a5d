"""The zygote (`services.core.host.zygote`) and the launcher's use of it (`services.prefork`): a forked
child behaves as a Popen'd `python -m` would (exit code, signals, its own process group, its own
environment and descriptors, its log), and every way the zygote can fail leaves no orphan and falls
back to Popen."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.core.config.run import SERVICE_NAMES, RunConfig, parse_config
from services.core.host import lifeline
from services.core.host.ports import pid_alive
from services.core.host.zygote import LOST_RETURNCODE, Zygote, ZygoteChild, ZygoteError
from services.prefork import ENV, PRELOAD, Launcher, forks

REPO = Path(__file__).resolve().parents[2]
CHILD = "tests.unit.zygote_child"


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), **extra)


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    z = Zygote.start(python=sys.executable, env=_env(ONLY_IN_THE_ZYGOTE="1"), log_path=tmp_path / "zygote.log")
    assert z.wait_ready(60), (tmp_path / "zygote.log").read_text()
    try:
        yield z
    finally:
        z.kill()
        z.stop(timeout=5)


def _spawn(z: Zygote, tmp_path: Path, code: str, **env: str) -> ZygoteChild:
    return z.spawn(CHILD, [code], _env(**env), tmp_path / "child.log")


def _until(cond: object, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_forked_child_reports_its_pid_and_its_exit_code(zygote: Zygote, tmp_path: Path) -> None:
    out = tmp_path / "pid"
    child = _spawn(zygote, tmp_path, f"import os, sys; open({str(out)!r}, 'w').write(str(os.getpid())); sys.exit(7)")
    assert child.wait(timeout=30) == 7
    assert child.returncode == child.poll() == 7
    assert int(out.read_text()) == child.pid


def test_an_uncaught_exception_exits_1_with_its_traceback_in_the_childs_log(zygote: Zygote, tmp_path: Path) -> None:
    child = _spawn(zygote, tmp_path, "print('hello from the child'); raise ValueError('boom')")
    assert child.wait(timeout=30) == 1
    log = (tmp_path / "child.log").read_text()
    assert "hello from the child" in log and "ValueError: boom" in log and "Traceback" in log


def test_a_forked_child_runs_its_exit_handlers_and_ends_its_child_processes_as_an_interpreter_exit_would(
        zygote: Zygote, tmp_path: Path) -> None:
    # The fork leaves by os._exit (no teardown of the modules the zygote loaded), but what an exit
    # must still do happens: atexit handlers, multiprocessing's end of its daemonic children, stdio.
    flag, grandchild = tmp_path / "atexit-ran", tmp_path / "grandchild-pid"
    code = (f"import atexit, multiprocessing, os, sys, time; "
            f"atexit.register(lambda: open({str(flag)!r}, 'w').write('yes')); "
            f"p = multiprocessing.get_context('fork').Process(target=time.sleep, args=(60,), daemon=True); p.start(); "
            f"open({str(grandchild)!r}, 'w').write(str(p.pid)); "
            f"sys.stdout.write('unflushed line'); sys.exit('a message for sys.exit')")
    child = _spawn(zygote, tmp_path, code)
    assert child.wait(timeout=30) == 1  # sys.exit with a message: printed, status 1
    assert flag.read_text() == "yes"
    assert _until(lambda: not pid_alive(int(grandchild.read_text())))
    log = (tmp_path / "child.log").read_text()
    assert "unflushed line" in log and "a message for sys.exit" in log
    assert _spawn(zygote, tmp_path, "import sys; sys.exit(None)").wait(timeout=30) == 0
    assert _spawn(zygote, tmp_path, "import sys; sys.exit(300)").wait(timeout=30) == 300 & 0xFF


def test_a_child_killed_by_a_signal_reports_minus_the_signal_as_popen_does(zygote: Zygote, tmp_path: Path) -> None:
    child = _spawn(zygote, tmp_path, "import time; time.sleep(60)")
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=10) == -signal.SIGTERM
    child.kill()  # after its exit: nothing, as Popen
    other = _spawn(zygote, tmp_path, "import time; time.sleep(60)")
    other.kill()
    assert other.wait(timeout=10) == -signal.SIGKILL


def test_the_child_leads_its_own_session_so_killpg_takes_its_children_too(zygote: Zygote, tmp_path: Path) -> None:
    out = tmp_path / "grandchild"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f" open({str(out)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    child = _spawn(zygote, tmp_path, code)
    assert _until(lambda: out.exists() and out.read_text())
    grandchild = int(out.read_text())
    assert os.getsid(child.pid) == child.pid and os.getpgid(child.pid) == child.pid
    assert os.getpgid(grandchild) == child.pid
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert _until(lambda: not pid_alive(grandchild))


def test_the_child_gets_exactly_the_requested_environment(zygote: Zygote, tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    child = _spawn(zygote, tmp_path, f"import json, os; open({str(out)!r}, 'w').write(json.dumps(dict(os.environ)))",
                   ONLY_IN_THE_REQUEST="2")
    assert child.wait(timeout=30) == 0
    got = json.loads(out.read_text())
    assert got["ONLY_IN_THE_REQUEST"] == "2" and "ONLY_IN_THE_ZYGOTE" not in got
    # Its lifeline is the zygote, its parent (lifeline.watch_launcher reads and drops these two).
    assert got.pop(lifeline.LAUNCHER_ENV) == str(zygote.pid) and got.pop(lifeline.PDEATHSIG_ENV) == "1"
    assert got == _env(ONLY_IN_THE_REQUEST="2")


def test_the_child_holds_no_descriptor_of_the_zygote_only_its_log_and_dev_null(zygote: Zygote, tmp_path: Path) -> None:
    out = tmp_path / "fds.json"
    code = ("import json, os; fds = {}\nfor fd in os.listdir('/proc/self/fd'):\n"
            "    try: fds[fd] = os.readlink(f'/proc/self/fd/{fd}')\n"
            "    except OSError: pass  # the listing's own, closed by now\n"
            f"open({str(out)!r}, 'w').write(json.dumps(fds))")
    child = _spawn(zygote, tmp_path, code)
    assert child.wait(timeout=30) == 0
    fds = json.loads(out.read_text())
    assert fds == {"0": "/dev/null", "1": str(tmp_path / "child.log"), "2": str(tmp_path / "child.log")}


def test_a_killed_zygote_takes_its_children_down_and_spawns_fail(zygote: Zygote, tmp_path: Path) -> None:
    # A service's first act (services.core.serving.entry): tie itself to its parent, the zygote.
    code = "from services.core.host import lifeline; import time; lifeline.watch_launcher(); time.sleep(60)"
    child = _spawn(zygote, tmp_path, code)
    time.sleep(0.5)  # past watch_launcher
    os.kill(zygote.pid, signal.SIGKILL)
    assert _until(lambda: not pid_alive(child.pid)), "the zygote's child outlived it"
    assert child.wait(timeout=10) == LOST_RETURNCODE  # its real status went with the zygote
    assert not zygote.alive
    with pytest.raises(ZygoteError):
        _spawn(zygote, tmp_path, "pass")


LAUNCHER = """
import os, sys, time
from pathlib import Path
from services.core.host import lifeline
from services.core.host.zygote import Zygote
tmp = Path(sys.argv[1])
env = lifeline.launcher_env(dict(os.environ))
z = Zygote.start(python=sys.executable, env=env, log_path=tmp / "zygote.log")
assert z.wait_ready(60)
code = "from services.core.host import lifeline; import time; lifeline.watch_launcher(); time.sleep(60)"
child = z.spawn("tests.unit.zygote_child", [code], env, tmp / "child.log")
time.sleep(0.5)
print(z.pid, child.pid, flush=True)
time.sleep(60)
"""


def test_a_sigkilled_launcher_takes_the_zygote_and_its_children_down(tmp_path: Path) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], env=_env(), cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        zygote, child = map(int, launcher.stdout.readline().split())
        launcher.kill()
        launcher.wait(timeout=10)
        assert _until(lambda: not pid_alive(zygote), 5), "the zygote outlived its launcher"
        assert _until(lambda: not pid_alive(child), 10), "a forked service outlived its launcher"
    finally:
        launcher.kill()
        launcher.wait()


def test_a_zygote_still_importing_stops_at_once(tmp_path: Path) -> None:
    z = Zygote.start(python=sys.executable, env=_env(), log_path=tmp_path / "zygote.log",
                     preload=["tests.unit.zygote_slow_import"])
    assert not z.wait_ready(1.0) and z.alive
    t0 = time.monotonic()
    z.stop(timeout=5)
    assert time.monotonic() - t0 < 2 and not z.alive
    with pytest.raises(ZygoteError):
        _spawn(z, tmp_path, "pass")


def test_a_preload_that_imports_grpc_is_refused_and_the_launcher_falls_back_to_popen(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    z = Zygote.start(python=sys.executable, env=_env(), log_path=tmp_path / "zygote.log", preload=["grpc"])
    try:
        assert not z.wait_ready(60)
        assert _until(lambda: not z.alive)
        assert z.refused is not None and "grpc" in z.refused
    finally:
        z.stop()
    launcher = Launcher(tmp_path, sys.executable)
    launcher.zygote = z  # as start_zygote would have, with this preload
    with caplog.at_level(logging.WARNING, logger="rlfleet.fleet"):
        proc = launcher.spawn(CHILD, ["import sys; sys.exit(5)"], _env(), tmp_path / "child.log", fork=True)
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=30) == 5
    assert any("Popen" in r.getMessage() and "grpc" in str(getattr(r, "error", "")) for r in caplog.records)
    assert launcher.zygote is None  # and stays so for this run


def test_a_launcher_whose_zygote_died_starts_services_with_popen(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path, sys.executable)
    launcher.start_zygote()
    assert launcher.zygote is not None and launcher.zygote.wait_ready(60)
    forked = launcher.spawn(CHILD, ["import sys; sys.exit(3)"], _env(), tmp_path / "a.log", fork=True)
    assert isinstance(forked, ZygoteChild) and forked.wait(timeout=30) == 3
    assert lifeline.holders(tmp_path) == [f"zygote pid {launcher.zygote.pid}"]  # a stray the next launcher names
    launcher.kill()
    proc = launcher.spawn(CHILD, ["import sys; sys.exit(4)"], _env(), tmp_path / "b.log", fork=True)
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=30) == 4
    launcher.stop()


def test_fleets_handed_a_zygote_fork_from_it_and_leave_it_running(zygote: Zygote, tmp_path: Path) -> None:
    for run in ("run1", "run2"):
        launcher = Launcher(tmp_path / run, sys.executable, zygote)
        launcher.start_zygote()  # it has one: nothing started
        assert launcher.zygote is zygote
        child = launcher.spawn(CHILD, ["import sys; sys.exit(6)"], _env(), tmp_path / f"{run}.log", fork=True)
        assert isinstance(child, ZygoteChild) and child.wait(timeout=30) == 6
        launcher.kill()  # what a launcher's hard exit does: its own processes only
        launcher.stop()
        assert zygote.ready
        assert lifeline.holders(tmp_path / run) == []  # not the run's to name or stop


def test_the_default_preload_imports_no_grpc_and_starts_no_thread() -> None:
    code = (f"from services.core.host.zygote import preload\nprint('refused:', preload({list(PRELOAD)!r}))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "refused: None", p.stderr[-2000:]
    assert "preload failed" not in p.stderr, p.stderr[-2000:]


def _cfg(tmp_path: Path, **sections: dict[str, object]) -> RunConfig:
    data: dict[str, object] = {"run": {"dir": str(tmp_path)}, **sections}
    return parse_config(data, source="test")


def test_only_the_cpu_services_that_import_torch_are_forked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    cfg = _cfg(tmp_path)
    assert [n for n in SERVICE_NAMES if forks(cfg, n, False)] == ["actor", "critic", "reference"]
    assert not forks(cfg, "actor", True)  # services pinned to GPUs
    gpu_engine = _cfg(tmp_path, generation={"device": "cuda"})
    assert not forks(gpu_engine, "actor", False) and forks(gpu_engine, "reference", False)
    gpu_scorer = _cfg(tmp_path, services={"reference": {"device": "cuda"}})
    assert not forks(gpu_scorer, "reference", False)
    monkeypatch.setenv(ENV, "0")
    assert not forks(cfg, "actor", False)

"""The `rlfleet` command as a user runs it: a real subprocess, real files, real ports, real fleets.

Every failure case checks the same contract: a non-zero exit, one line on stderr naming the
problem, and no traceback. Cases that need a model use the session's prebuilt tiny model.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.core.journal.journal import Journal
from services.prefork import ENV as ZYGOTE_ENV
from tests.fleet_helpers import commit_steps, processes_of

ROOT = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).with_name("rlfleet")
RLFLEET = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "services.cli"]


def rlfleet(*args: str, cwd: Path | None = None, timeout: float = 120, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ if env is None else env, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.run([*RLFLEET, *args], cwd=cwd or ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def write_config(path: Path, run_dir: Path, **sections: Any) -> Path:
    data: dict[str, Any] = {"run": {"name": "cli", "dir": str(run_dir), "max_steps": 2}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(data))
    return path


def assert_one_line_error(p: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert p.returncode != 0, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_an_unknown_task_parameter_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "run", task={"params": {"max_operandz": 3}})
    for cmd in (["train", "--local"], ["up"]):
        t0 = time.monotonic()
        p = rlfleet(*cmd, "--config", str(cfg))
        assert_one_line_error(p, "max_operandz", "allowed: max_operand")
        assert time.monotonic() - t0 < 30  # pre-flight: seconds, not a fleet start (generous under CPU load)
    assert not (tmp_path / "run" / "redis").exists()


def test_a_missing_model_directory_is_one_line_naming_the_field(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "run", models={"policy": {"path": str(tmp_path / "none")}})
    p = rlfleet("up", "--config", str(cfg))
    assert_one_line_error(p, "models.policy.path", str(tmp_path / "none"), "does not exist")
    assert not (tmp_path / "run" / "redis").exists()


def test_a_missing_reward_module_is_one_line_naming_the_module(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "run", task={"reward_fn": "no_such_reward_mod:score"})
    assert_one_line_error(rlfleet("up", "--config", str(cfg)), "no_such_reward_mod")


def test_a_model_directory_without_tokenizer_files_is_refused_before_start(tmp_path: Path, tiny_model: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny_model.iterdir():
        if not f.name.startswith("tokenizer"):
            (bare / f.name).write_bytes(f.read_bytes())
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "run", models={"policy": {"path": str(bare)}})
    assert_one_line_error(rlfleet("up", "--config", str(cfg)), "no tokenizer files", str(bare))
    assert not (tmp_path / "run" / "redis").exists()


def test_a_missing_redis_server_is_one_line_with_the_fix(tmp_path: Path, tiny_model: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "run", models={"policy": {"path": str(tiny_model)}})
    empty = tmp_path / "empty-path"
    empty.mkdir()
    p = rlfleet("up", "--config", str(cfg), env=dict(os.environ, PATH=str(empty)))
    assert_one_line_error(p, "redis-server not found", "redis.url")


def _unwritable_run_dir(tmp_path: Path) -> Path:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        (ro / "probe").write_text("x")
    except OSError:
        return ro
    (ro / "probe").unlink()
    return Path("/sys/rlfleet-test-run")  # root writes through permissions; sysfs takes no new entries


def test_a_read_only_run_directory_names_the_directory_not_the_report(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = _unwritable_run_dir(tmp_path)
    cfg = write_config(tmp_path / "c.yaml", run_dir, models={"policy": {"path": str(tiny_model)}})
    try:
        for cmd in (["up"], ["train", "--local"]):
            line = assert_one_line_error(rlfleet(*cmd, "--config", str(cfg)), str(run_dir), "not writable")
            assert "report" not in line
    finally:
        (tmp_path / "ro").chmod(0o755)


def test_swap_on_a_stopped_run_says_it_is_not_running(tmp_path: Path) -> None:
    # What a stopped fleet leaves behind: its service files, naming processes that have exited.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    services = tmp_path / "run" / "services"
    services.mkdir(parents=True)
    (services / "critic.json").write_text(json.dumps({"pid": gone.pid, "host": "127.0.0.1", "http_port": 9}))
    p = rlfleet("swap", "critic", "--run-dir", str(tmp_path / "run"))
    assert_one_line_error(p, "critic", "not running", "rlfleet up")


def test_a_taken_fixed_port_is_refused_naming_service_port_and_holder(tmp_path: Path, tiny_model: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cfg = write_config(tmp_path / "c.yaml", tmp_path / "run", models={"policy": {"path": str(tiny_model)}},
                           services={"reward": {"http_port": port}})
        t0 = time.monotonic()
        p = rlfleet("up", "--config", str(cfg))
        line = assert_one_line_error(p, "reward http_port", str(port), f"pid {os.getpid()}")
        assert "services.reward.http_port" in line
        assert time.monotonic() - t0 < 30
    assert not (tmp_path / "run" / "services").exists()  # no service was started


def test_up_on_a_finished_run_starts_nothing_and_says_how_to_extend(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    journal = Journal.open(run_dir / "journal")
    commit_steps(journal, 2)
    journal.close()
    cfg = write_config(tmp_path / "c.yaml", run_dir, models={"policy": {"path": str(tiny_model)}})
    p = rlfleet("up", "--config", str(cfg))
    assert p.returncode == 0, p.stderr
    assert "run already finished (2 steps)" in p.stdout and "--max-steps" in p.stdout
    assert not (run_dir / "redis").exists() and not (run_dir / "services").exists()


STOPPED_WITHIN_S = 30.0  # a signal at any moment of `rlfleet up`: the launcher and all it started are gone


def _resumable_run(tmp_path: Path, tiny_model: Path) -> tuple[Path, Path]:
    """A run directory whose journal has step 1 of 2 committed, and its config."""
    run_dir = tmp_path / "run"
    journal = Journal.open(run_dir / "journal")
    commit_steps(journal, 1)
    journal.close()
    return run_dir, write_config(tmp_path / "c.yaml", run_dir, models={"policy": {"path": str(tiny_model)}})


def _up(cfg: Path, cmd: list[str] | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.Popen([*(cmd or RLFLEET), "up", "--config", str(cfg)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def _assert_stops(proc: subprocess.Popen[str], run_dir: Path, sig: signal.Signals, line: str,
                  t_signal: float) -> None:
    """The launcher exits 128 + signal within STOPPED_WITHIN_S of it, says one line, no traceback,
    and leaves no process of the run (service, its children, redis-server) behind."""
    try:
        out, err = proc.communicate(timeout=max(1.0, t_signal + STOPPED_WITHIN_S - time.monotonic()))
        hung = False
    except subprocess.TimeoutExpired:
        hung = True
        proc.kill()
        out, err = proc.communicate()
    took = time.monotonic() - t_signal
    left = processes_of(run_dir)
    for entry in left:  # a failure here must not leave a fleet running for the next test
        with contextlib.suppress(OSError):
            os.kill(int(entry.split()[0]), signal.SIGKILL)
    assert not hung, (f"rlfleet up still running {STOPPED_WITHIN_S:.0f}s after {sig.name}; its processes: {left}",
                      out[-1500:], err[-1500:])
    assert left == [], f"left running {took:.1f}s after {sig.name} (rlfleet up exited {proc.returncode})"
    assert proc.returncode == 128 + sig, (proc.returncode, out[-1500:], err[-1500:])
    assert "Traceback" not in out + err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(line), err


def test_up_on_a_run_with_steps_left_says_it_resumes_from_the_journals_step(tmp_path: Path, tiny_model: Path) -> None:
    """And a Ctrl-C right after that line (torch still loading) stops it within seconds. It used to
    be lost at times: torch's import drops a KeyboardInterrupt raised while it initialises numpy, and
    the launcher went on to start Redis and every service."""
    run_dir, cfg = _resumable_run(tmp_path, tiny_model)
    proc = _up(cfg)
    try:
        first = proc.stdout.readline()  # type: ignore[union-attr]
        assert "resuming cli from step 1 of 2" in first, first
    finally:
        proc.send_signal(signal.SIGINT)
        t_signal = time.monotonic()
    _assert_stops(proc, run_dir, signal.SIGINT, "interrupted", t_signal)


def test_sigterm_while_the_services_start_stops_each_service_and_redis(tmp_path: Path, tiny_model: Path) -> None:
    """The services run in their own sessions (a terminal's Ctrl-C reaches the launcher only): a
    signal while they load must still take every one of them, and Redis, down with the launcher."""
    run_dir, cfg = _resumable_run(tmp_path, tiny_model)
    proc = _up(cfg)
    try:
        deadline = time.monotonic() + 180
        # redis-server, actor, reward, controller: the launcher opens a service's log before its process
        # execs (and only then names the run directory), so the count is waited for too.
        while not (run_dir / "logs" / "controller.log").exists() or len(processes_of(run_dir)) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, "rlfleet up never started the controller"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        t_signal = time.monotonic()
    _assert_stops(proc, run_dir, signal.SIGTERM, "stopped by SIGTERM: stopping the fleet", t_signal)


_SWALLOWING_PREPARE = """
import os, signal, sys, time
from pathlib import Path
import services.fleet as fleet
real = fleet.resolve_fleet_config
def resolve(*a, **kw):
    Path(sys.argv[-1] + ".signalled").touch()
    try:  # what torch's import does to a KeyboardInterrupt that comes while it loads numpy
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    except KeyboardInterrupt:
        pass
    return real(*a, **kw)
fleet.resolve_fleet_config = resolve
from services.cli import main
sys.exit(main())
"""


def test_an_interrupt_a_library_swallows_still_stops_the_launcher(tmp_path: Path, tiny_model: Path) -> None:
    """SIGINT after Redis is up, while the launcher prepares the services' config, its KeyboardInterrupt
    swallowed on the way: the launcher still stops at its next step, Redis included, instead of starting
    the run."""
    run_dir, cfg = _resumable_run(tmp_path, tiny_model)
    proc = _up(cfg, [sys.executable, "-c", _SWALLOWING_PREPARE])
    deadline = time.monotonic() + 180
    while not Path(f"{cfg}.signalled").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    _assert_stops(proc, run_dir, signal.SIGINT, "interrupted: stopping the fleet", time.monotonic())
    assert (run_dir / "redis").is_dir() and not (run_dir / "logs" / "actor.log").exists()  # no service started


def test_train_local_refuses_a_fleet_runs_directory_and_keeps_its_metrics(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    Journal.open(run_dir / "journal").close()
    rows = '{"step": 1, "reward_mean": 0.5}\n'
    (run_dir / "metrics.jsonl").write_text(rows)
    cfg = write_config(tmp_path / "c.yaml", run_dir, models={"policy": {"path": str(tiny_model)}})
    assert_one_line_error(rlfleet("train", "--local", "--config", str(cfg)), "fleet run", "--run-dir")
    assert (run_dir / "metrics.jsonl").read_text() == rows


def test_version_and_the_packaged_default_config_work_from_any_directory(tmp_path: Path) -> None:
    p = rlfleet("--version", cwd=tmp_path)
    assert p.returncode == 0 and re.fullmatch(r"rlfleet \S+", p.stdout.strip()), p
    # No --config, in a directory without examples/: the packaged tiny config.
    p = rlfleet("plan", "--json", "--inventory", str(_no_gpus(tmp_path)), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert Path(plan["config"]).name == "tiny-cpu.yaml" and "services" in Path(plan["config"]).parts
    assert plan["services_needed"] == ["controller", "actor", "reference", "reward"]


def _no_gpus(tmp_path: Path) -> Path:
    inv = tmp_path / "inventory.yaml"
    inv.write_text("gpus: []\n")
    return inv


@pytest.mark.slow
def test_train_local_prints_progress_lines_with_an_eta_when_not_a_terminal(tmp_path: Path, tiny_model: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "run", models={"policy": {"path": str(tiny_model)}},
                       run={"max_steps": 3, "eval_every": 0}, task={"eval_size": 4})
    p = rlfleet("train", "--local", "--config", str(cfg), "--progress-every", "0", timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if "step " in ln]
    assert [int(re.search(r"step (\d+)/3", ln).group(1)) for ln in lines] == [1, 2, 3], p.stdout  # type: ignore[union-attr]
    assert all(" eta " in ln and "reward" in ln for ln in lines)
    assert re.search(r"eta \d+s", lines[-1])


@pytest.mark.slow
def test_two_fleets_started_together_on_one_host_get_distinct_ports(tmp_path: Path, tiny_model: Path) -> None:
    """Both on the default ports: each launcher picks distinct free ports and claims them, so the
    two runs bind disjoint ports and both finish."""
    cfgs = [write_config(tmp_path / f"c{i}.yaml", tmp_path / f"run{i}", models={"policy": {"path": str(tiny_model)}},
                         algo={"kl_coef": 0.0}, run={"name": f"cli{i}", "max_steps": 2})
            for i in range(2)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([*RLFLEET, "up", "--config", str(c), "--ready-timeout", "240"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for c in cfgs]
    try:
        outs = [p.communicate(timeout=480) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=60)
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, (out, err)
        assert "Traceback" not in err
        assert "preflight passed" not in out + err  # the launcher's INFO records go to its log file only
    # Each launcher's start-up, step by step, as JSON lines next to the services' logs.
    for i in range(2):
        recs = [json.loads(ln) for ln in (tmp_path / f"run{i}" / "logs" / "launcher.log").read_text().splitlines()]
        msgs = [r["msg"] for r in recs]
        # The zygote the actor forks from (services.prefork) starts first: its imports overlap the rest.
        zygote = [] if os.environ.get(ZYGOTE_ENV) == "0" else ["zygote started"]
        assert msgs[:3 + len(zygote)] == ["preflight passed", *zygote, "redis started", "models prepared"], msgs
        started = [r["child"] for r in recs if r["msg"] == "service started"]
        assert {"actor", "controller", "reward"} <= set(started) and len(set(started)) == len(started), started
        assert msgs.index("all services ready") > msgs.index("service started")
        assert all(r["service"] == "launcher" and r["ts"].endswith("Z") for r in recs)
    ports = []
    for i in range(2):
        fleet = yaml.safe_load((tmp_path / f"run{i}" / "fleet.yaml").read_text())
        mine = [ep[k] for n, ep in fleet["services"].items() if n in ("controller", "actor", "reward")
                for k in ("grpc_port", "http_port")]
        assert len(set(mine)) == len(mine) and all(mine), mine
        mine.append(int(fleet["redis"]["url"].rsplit(":", 1)[1].split("/")[0]))
        ports.append(set(mine))
    assert not ports[0] & ports[1], ports

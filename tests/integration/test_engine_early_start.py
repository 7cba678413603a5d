"""The actor's engine process starts before the actor imports torch (`services.models.engines.boot`):
on an H200 the engine's imports and the actor's ran one after the other, ~30 s of the time to first
step. Real processes: a fresh interpreter spawns the real transformers engine in a child, then builds
the engine the way the actor does and must be handed that very child. That child also dies with the
actor that spawned it, even one killed while its engine still starts (`services.models.engines.child`)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest
import yaml

from services.core.host.ports import pid_alive
from services.models.engines.proc import FORKSERVER_ENV
from tests.fleet_helpers import EXAMPLE

# Real actor and engine processes, but no fleet: it runs beside the unit tests (make test-unit). The one
# bound (an engine outlives its killed actor by under 10 s) is many times the engine's parent poll (engines.child).
pytestmark = [pytest.mark.timeout(240), pytest.mark.shares_host]
REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from pathlib import Path
from services.core.config.run import load_config
from services.models.engines import boot as engine_boot
cfg = load_config(sys.argv[1])
engine_boot.start_early(cfg)
early = engine_boot._started
torch_at_spawn = "torch" in sys.modules
if len(sys.argv) > 2:  # the actor asks for another engine than the one started early
    cfg = cfg.model_copy(update={"generation": cfg.generation.model_copy(update={"micro_batch": 3})})
from services.models.engine import SamplingParams
from services.models.engines.factory import make_engine
eng = make_engine(cfg.generation.engine, Path(cfg.models.policy.path),
                  dtype=cfg.generation.engine_dtype(cfg.models.policy.dtype),
                  **cfg.generation.engine_kwargs(cfg.run_dir))
out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0.0))
# Tensors cross the pipes the torch-free spawn made: torch's reductions apply to them all the same.
from transformers import AutoModelForCausalLM
eng.update_weights(AutoModelForCausalLM.from_pretrained(cfg.models.policy.path).named_parameters(), 1)
assert eng.version == 1
print(json.dumps({"torch_at_spawn": torch_at_spawn, "early_pid": early.proc.pid if early else None,
                  "early_alive": early.proc.is_alive() if early else None,
                  "engine_pid": eng.describe().get("process") if hasattr(eng, "describe") else None,
                  "tokens": len(out[0].token_ids)}))
eng.close()
"""


def _config(tmp_path: Path, model: Path, **generation: Any) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["run"]["dir"] = str(tmp_path / "run")
    data["models"]["policy"]["path"] = str(model)
    data["generation"].update(generation)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def _run(tmp_path: Path, model: Path, *extra: str, **generation: Any) -> dict[str, Any]:
    cfg = _config(tmp_path, model, **generation)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(cfg), *extra], cwd=REPO, capture_output=True,
                          text=True, timeout=200, env={"RLFLEET_TORCH_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_the_engine_process_is_spawned_before_torch_is_imported_and_the_actor_is_handed_that_child(
        tmp_path: Path, random_model: Path) -> None:
    out = _run(tmp_path, random_model, process=True)
    assert out["torch_at_spawn"] is False
    assert out["engine_pid"] == out["early_pid"] and out["tokens"] == 3


def test_an_engine_in_the_actors_own_process_starts_nothing_early(tmp_path: Path, random_model: Path) -> None:
    out = _run(tmp_path, random_model, process=False)
    assert out["early_pid"] is None and out["tokens"] == 3


def test_a_child_started_for_another_engine_is_stopped_and_a_new_one_started(
        tmp_path: Path, random_model: Path) -> None:
    out = _run(tmp_path, random_model, "other", process=True)
    assert out["early_pid"] is not None and out["engine_pid"] != out["early_pid"]
    assert out["early_alive"] is False and out["tokens"] == 3


@pytest.mark.parametrize(("transfer", "early"), [("auto", True), ("ipc", True), ("collective", False)])
def test_only_an_engine_that_takes_its_weights_by_ipc_starts_early(
        tmp_path: Path, random_model: Path, transfer: str, early: bool) -> None:
    # The same rule make_engine applies (transfer_route.route): a collective transfer needs torch in the
    # actor before its engine starts.
    from services.core.config.run import load_config
    from services.models.engines.boot import child_options

    cfg = load_config(_config(tmp_path, random_model, process=True, weight_transfer=transfer))
    assert (child_options(cfg) is not None) is early


def test_the_early_child_gets_every_engine_option_make_engine_would_pass_it() -> None:
    # engine_boot cannot import the factory (torch); it names make_engine's own arguments instead, and an
    # argument added to make_engine but not there would reach the child as an engine option: the early
    # child would then never match, and every start would spawn a second one.
    import inspect

    from services.models.engines.boot import _FACTORY_ARGS
    from services.models.engines.factory import make_engine

    own = set(inspect.signature(make_engine).parameters) - {"name", "model_path", "dtype", "device", "micro_batch",
                                                             "options"}
    assert own == set(_FACTORY_ARGS)


# The actor up to where it has its engine: the child spawned early, then (with "ready") adopted by
# make_engine and waiting for a request; with "forked", no early child: make_engine's own, forked from
# a forkserver (RLFLEET_ENGINE_FORKSERVER=1). It prints the child's pid, then whether it is ready.
ACTOR = """
import json, sys, time
from pathlib import Path
from services.core.config.run import load_config
from services.core.observability.logs import setup_logging
from services.models.engines import boot as engine_boot
setup_logging("actor")
cfg = load_config(sys.argv[1])
if sys.argv[2] == "forked":
    from services.models.engines.factory import make_engine
    eng = make_engine(cfg.generation.engine, Path(cfg.models.policy.path),
                      dtype=cfg.generation.engine_dtype(cfg.models.policy.dtype),
                      **cfg.generation.engine_kwargs(cfg.run_dir))
    print(json.dumps({"engine_pid": eng.describe()["process"]}), flush=True)
    time.sleep(600)
engine_boot.start_early(cfg)
print(json.dumps({"engine_pid": engine_boot._started.proc.pid}), flush=True)
if sys.argv[2] == "ready":
    from services.models.engines.factory import make_engine
    eng = make_engine(cfg.generation.engine, Path(cfg.models.policy.path),
                      dtype=cfg.generation.engine_dtype(cfg.models.policy.dtype),
                      **cfg.generation.engine_kwargs(cfg.run_dir))
    print(json.dumps({"ready": eng.describe()["process"]}), flush=True)
time.sleep(600)
"""


def _lines(stream: IO[str]) -> queue.Queue[str]:
    out: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [out.put(line) for line in stream], daemon=True).start()
    return out


def _reader_opened(fifo: Path) -> int | None:
    """A write end of `fifo` once some process has opened it to read (ENXIO until then)."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as err:
        if err.errno != errno.ENXIO:
            raise
        return None


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


@pytest.mark.parametrize("when", ["starting", "ready", "forked"])
def test_an_engine_process_exits_when_its_actor_is_killed(tmp_path: Path, random_model: Path, when: str) -> None:
    """kill -9 (or the OOM killer) of the actor leaves no engine process behind to hold its share of
    the GPU next to the restarted actor's engine: neither one still loading its model (it reads no
    pipe for tens of seconds with vLLM) nor one waiting for a request, nor one forked by a forkserver
    (whose OS parent is that server, not the actor)."""
    model = tmp_path / "model"
    shutil.copytree(random_model, model)
    fifo = model / "tokenizer_config.json"
    if when == "starting":
        # The engine's start blocks on this file (the first it reads of the model) for as long as the
        # test holds it open: the actor dies while its engine is, for sure, loading the model.
        fifo.unlink()
        os.mkfifo(fifo)
    log = (tmp_path / "actor.log").open("w")
    actor = subprocess.Popen([sys.executable, "-c", ACTOR, str(_config(tmp_path, model, process=True)), when],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
                             env={"RLFLEET_TORCH_THREADS": "1", "PATH": "/usr/bin:/bin",
                                  **({FORKSERVER_ENV: "1"} if when == "forked" else {})})
    assert actor.stdout is not None
    lines = _lines(actor.stdout)
    pid, held = 0, None
    try:
        pid = int(json.loads(lines.get(timeout=60))["engine_pid"])
        deadline = time.monotonic() + 150
        if when == "starting":
            while (held := _reader_opened(fifo)) is None:
                assert pid_alive(pid) and time.monotonic() < deadline, "the engine never began to load the model"
                time.sleep(0.1)
        elif when == "ready":
            assert json.loads(lines.get(timeout=150))["ready"] == pid
        else:
            server = _ppid(pid)
            assert server != actor.pid and _ppid(server) == actor.pid  # forked by the actor's forkserver
        actor.kill()
        actor.wait(10)
        t0 = time.monotonic()
        while (pid_alive(pid) or (when == "forked" and pid_alive(server))) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not pid_alive(pid), "the engine process outlived its actor by 10 s"
        assert when != "forked" or not pid_alive(server), "the forkserver outlived its actor by 10 s"
        rows = [json.loads(line) for line in (tmp_path / "actor.log").read_text().splitlines()
                if line.startswith("{")]
        last = [r for r in rows if r["service"] == "actor.engine"][-1]
        assert last["msg"].startswith("engine process exits") and last["parent"] == actor.pid, rows[-3:]
    finally:
        actor.kill()
        actor.wait(10)
        if pid and pid_alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if held is not None:
            os.close(held)
        log.close()


# An engine process that started processes of its own, as vLLM starts its EngineCore.
ENGINE_WITH_CHILDREN = """
import json, multiprocessing, subprocess, sys, time
from services.models.engines import child as engine_child

def engine(out):
    engine_child.watch_parent()
    kid = subprocess.Popen(["sh", "-c", "sleep 120 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    out.send([multiprocessing.current_process().pid, kid.pid, int(kid.stdout.readline())])
    time.sleep(120)

if __name__ == "__main__":
    mine, theirs = multiprocessing.get_context("spawn").Pipe()
    multiprocessing.get_context("spawn").Process(target=engine, args=(theirs,), daemon=True).start()
    print(json.dumps(mine.recv()), flush=True)
    time.sleep(120)
"""


def test_an_orphaned_engine_process_takes_the_processes_it_started_with_it(tmp_path: Path) -> None:
    script = tmp_path / "actor.py"
    script.write_text(ENGINE_WITH_CHILDREN)
    actor = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert actor.stdout is not None
    lines = _lines(actor.stdout)
    pids: list[int] = []
    try:
        pids = json.loads(lines.get(timeout=60))
        assert all(pid_alive(p) for p in pids)
        actor.kill()
        actor.wait(10)
        t0 = time.monotonic()
        while any(pid_alive(p) for p in pids) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert [p for p in pids if pid_alive(p)] == [], "the engine or what it started outlived the actor by 10 s"
    finally:
        actor.kill()
        actor.wait(10)
        for p in pids:
            if pid_alive(p):
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)

"""The compose stack end to end on this host: local images, CPU profile, a PPO run with a critic
hot swap, audit from the host, fleet metrics through Prometheus; then the extras images
(`scripts/docker_build.sh --extras`) running GRPO with a reference on a reasoning-gym task, through
LoRA, with the TensorBoard, W&B (offline) and MLflow (file store) trackers.

Needs a Docker engine (started here when none runs and we are root: scripts/docker_engine.sh) and
PyPI for the image builds; skipped, saying why, when an engine cannot be had. Image builds are
cached across runs (base image by recipe label, service images by Docker's layer cache).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.core.host.redis_proc import free_port
from services.core.observability.trackers import read_state
from services.plan import plan_main
from tests.tracker_readers import expected_rows, mlflow_rows, tensorboard_rows, wandb_rows

pytestmark = [pytest.mark.slow, pytest.mark.docker]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.cpu.yml"
STEPS = 40  # enough that the critic is recreated mid-run even when steps take ~0.2 s
SERVICES = ("controller", "actor", "critic", "reward", "reference")
TIMINGS: dict[str, float] = {}
# The extras images: what they add over the base ones, the run on them (GRPO with KL: controller,
# actor, reward, reference), and the trackers it writes into the run directory (no network).
EXTRAS = "tasks,track,lora"
EXTRAS_STEPS = 6
EXTRAS_SERVICES = ("controller", "actor", "reward", "reference")
TRACKERS = [{"kind": "tensorboard"}, {"kind": "wandb", "mode": "offline", "project": "rlfleet-compose"},
            {"kind": "mlflow", "experiment": "rlfleet-compose"}]
EXTRAS_TIMINGS: dict[str, float] = {}


def _run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float, check: bool = True,
         cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}"
                             f"\n--- stderr\n{p.stderr[-4000:]}")
    return p


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A running Docker engine and a compose command, or a skip that says exactly why. An engine
    started here is stopped again (by its pid) when the module's tests are done."""
    if shutil.which("docker") is None and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        pytest.skip("no docker client, and not root with apt-get to install docker.io")
    already = shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True, check=False, timeout=60).returncode == 0
    pidfile = tmp_path_factory.mktemp("dockerd") / "dockerd.pid"
    p = subprocess.run(["bash", str(ROOT / "scripts" / "docker_engine.sh")], capture_output=True, text=True,
                       timeout=300, check=False, env=dict(os.environ, RLFLEET_DOCKERD_PID=str(pidfile)))
    if p.returncode != 0:
        pytest.skip(f"no Docker engine: scripts/docker_engine.sh exited {p.returncode}: {p.stderr.strip()[-800:]}")
    if subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        cmd = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        cmd = ["docker-compose"]
    else:
        pytest.skip("Docker engine runs but neither `docker compose` nor `docker-compose` is installed")
    yield cmd
    if not already and pidfile.exists():
        pid = int(pidfile.read_text().strip())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                os.kill(pid, 0)
                time.sleep(0.5)


@pytest.fixture(scope="module")
def images(compose: list[str]) -> None:
    t0 = time.monotonic()
    p = _run(["bash", str(ROOT / "scripts" / "docker_base.sh")], timeout=600, check=False)
    if p.returncode != 0:
        pytest.fail(f"base image build failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    TIMINGS["base_image_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    p = _run(["bash", str(ROOT / "scripts" / "docker_build.sh"), "-f", str(COMPOSE_FILE)], timeout=900, check=False)
    if p.returncode != 0:
        pytest.fail(f"image build failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    TIMINGS["service_images_s"] = time.monotonic() - t0


@pytest.fixture(scope="module")
def extras_images(images: None) -> None:
    """The extras images, over the base images' layers (built first, by `images`)."""
    t0 = time.monotonic()
    p = _run(["bash", str(ROOT / "scripts" / "docker_build.sh"), "-f", str(COMPOSE_FILE), "--extras"],
             env=dict(os.environ, RLFLEET_EXTRAS=EXTRAS, RLFLEET_TAG="extras"), timeout=900, check=False)
    if p.returncode != 0:
        pytest.fail(f"extras image build failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    EXTRAS_TIMINGS["extras_images_s"] = time.monotonic() - t0


def _ports(names: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Fixed (in the config), distinct, and free on this host right now."""
    ports: set[int] = set()
    while len(ports) < 2 * len(names):
        ports.add(free_port())
    it = iter(sorted(ports))
    return {n: {"grpc_port": next(it), "http_port": next(it)} for n in names}


def _tiny_ppo(path: Path) -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    data["run"].update(name="compose", max_steps=STEPS)
    data["algo"].update(name="ppo", group_size=2, kl_coef=0.05, kl_in="reward")
    data["batch"] = {"prompts_per_step": 8, "prompts_per_message": 4}
    data["task"]["eval_size"] = 8
    # No cadence checkpoints: the only critic checkpoint is the one its drain writes.
    data["checkpoint"] = {"every": 1000, "keep": 100}
    data["services"] = _ports(SERVICES)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return data


def _tiny_extras(path: Path) -> dict[str, Any]:
    """The LoRA example on reasoning-gym's chain_sum (2-3 terms of 1-2 digits, the last number written
    is the answer), with every tracker, a held-out evaluation halfway and at the end."""
    data = yaml.safe_load((ROOT / "examples" / "tiny-cpu-lora.yaml").read_text())
    data["run"].update(name="compose-extras", max_steps=EXTRAS_STEPS, eval_every=EXTRAS_STEPS // 2,
                       trackers=TRACKERS)
    data["task"] = {"source": "reasoning_gym", "name": "chain_sum", "eval_size": 8,
                    "params": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2,
                               "answer_from": "last_number"}}
    data["algo"].update(group_size=2, kl_coef=0.05)  # kl_coef > 0: the reference runs
    data["generation"]["max_new_tokens"] = 6
    data["batch"] = {"prompts_per_step": 8, "prompts_per_message": 4}
    data["services"] = _ports(EXTRAS_SERVICES)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return data


def _get_json(url: str, timeout: float = 3.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _state(name: str) -> dict[str, Any]:
    out = subprocess.run(["docker", "inspect", name], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {}
    return json.loads(out.stdout)[0]


@contextlib.contextmanager
def _stack(compose: list[str], tmp_path: Path, cfg_path: Path, cfg: dict[str, Any], *, tag: str = "local",
           timings: dict[str, float] = TIMINGS) -> Iterator[dict[str, Any]]:
    """A compose project for `cfg` on the images tagged `tag` (not started yet); logs kept, and
    everything removed, at the end."""
    inventory = tmp_path / "no-gpus.yaml"
    inventory.write_text("gpus: []\n")
    env_file = tmp_path / "plan.env"
    assert plan_main(cfg_path, env_file, False, inventory) == 0
    data = tmp_path / "data"
    (data / "run").mkdir(parents=True)
    os.chmod(data / "run", 0o777)  # the services run as uid 10001
    project = f"rlfleet-test-{secrets.token_hex(3)}"
    env = dict(os.environ,
               REDIS_PASSWORD=secrets.token_urlsafe(16),
               RLFLEET_DATA_DIR=str(data),
               RLFLEET_REDIS_PORT=str(free_port()),
               RLFLEET_PROMETHEUS_PORT=str(free_port()),
               RLFLEET_TAG=tag,
               COMPOSE_PROJECT_NAME=project)
    env.pop("RLFLEET_EXTRAS", None)  # nothing is built here: `up` runs the images `tag` names
    base = [*compose, "-f", str(COMPOSE_FILE), "--env-file", str(env_file), "-p", project]
    info = {"cfg": cfg, "cfg_path": cfg_path, "env": env, "base": base, "project": project, "run_dir": data / "run",
            "ctl": f"http://127.0.0.1:{cfg['services']['controller']['http_port']}"}
    try:
        yield info
    finally:
        logs = _run([*base, "logs", "--no-color", "--tail", "40"], env=env, timeout=120, check=False)
        (tmp_path / "compose.log").write_text(logs.stdout + logs.stderr)
        t0 = time.monotonic()
        _run([*base, "down", "-v", "--remove-orphans", "--timeout", "60"], env=env, timeout=300, check=False)
        timings["down_s"] = time.monotonic() - t0


@pytest.fixture
def stack(compose: list[str], images: None, tmp_path: Path) -> Iterator[dict[str, Any]]:
    cfg_path = tmp_path / "tiny-ppo.yaml"
    with _stack(compose, tmp_path, cfg_path, _tiny_ppo(cfg_path)) as info:
        yield info


@pytest.fixture
def extras_stack(compose: list[str], extras_images: None, tmp_path: Path) -> Iterator[dict[str, Any]]:
    cfg_path = tmp_path / "tiny-extras.yaml"
    with _stack(compose, tmp_path, cfg_path, _tiny_extras(cfg_path), tag="extras", timings=EXTRAS_TIMINGS) as info:
        yield info


def _container(info: dict[str, Any], service: str) -> str:
    p = _run([*info["base"], "ps", "-q", service], env=info["env"], timeout=60)
    ids = p.stdout.split()
    assert ids, f"no container for {service}"
    return ids[0]


def _logs(info: dict[str, Any], *services: str) -> str:
    p = _run([*info["base"], "logs", "--no-color", "--tail", "30", *services], env=info["env"], timeout=60, check=False)
    return (p.stdout + p.stderr)[-6000:]


def _wait(what: str, fn: Any, timeout: float, info: dict[str, Any], poll: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{_logs(info)}")


def _controller_step(info: dict[str, Any]) -> int:
    try:
        return int((_get_json(f"{info['ctl']}/v1/status").get("detail") or {}).get("step", 0))
    except (urllib.error.URLError, OSError, ValueError):
        return -1


@pytest.mark.timeout(1200)
def test_compose_stack_runs_hot_swaps_the_critic_and_passes_audit(stack: dict[str, Any]) -> None:
    info, env, base = stack, stack["env"], stack["base"]
    t_all = time.monotonic()

    # Images: non-root, health-checked.
    for svc in SERVICES:
        img = json.loads(_run(["docker", "image", "inspect", f"rlfleet/{svc}:local"], timeout=30).stdout)[0]
        assert img["Config"]["User"] not in ("", "0", "root"), f"{svc} image runs as root"
        assert "healthcheck.py" in " ".join(img["Config"]["Healthcheck"]["Test"]), svc
        assert img["Config"]["Entrypoint"][-2:] == ["-m", f"services.{svc}"], img["Config"]["Entrypoint"]

    t0 = time.monotonic()
    p = _run([*base, "up", "-d"], env=env, timeout=600, check=False)
    if p.returncode != 0:  # say which container was unhealthy and why, not only that one was
        ps = _run([*base, "ps"], env=env, timeout=60, check=False)
        raise AssertionError(f"compose up exited {p.returncode}: {p.stderr[-1500:]}\n{ps.stdout}\n{_logs(info)}")
    TIMINGS["up_s"] = time.monotonic() - t0

    t0 = time.monotonic()
    step = _wait("controller step >= 2", lambda: (s := _controller_step(info)) >= 2 and s, 300, info, poll=0.2)
    TIMINGS["to_step_2_s"] = time.monotonic() - t0
    assert step < STEPS, f"the run reached step {step} before the critic could be swapped; raise STEPS"

    # Hot swap: SIGTERM (drain, checkpoint, exit 0), a new container reloads and rejoins.
    critic_url = f"http://127.0.0.1:{info['cfg']['services']['critic']['http_port']}/v1/status"
    version_before = int((_get_json(critic_url).get("detail") or {}).get("version", 0))
    old = _container(info, "critic")
    t0 = time.monotonic()
    _run([*base, "up", "-d", "--no-deps", "--force-recreate", "critic"], env=env, timeout=300)
    new = _container(info, "critic")
    assert new != old, "critic was not recreated"
    old_state = _state(old)  # gone after recreate in most engines; kept only if it could not be removed
    if old_state:
        assert old_state["State"]["ExitCode"] == 0, f"old critic exited {old_state['State']['ExitCode']}"
    _wait("the new critic to be healthy",
          lambda: (_state(new).get("State") or {}).get("Health", {}).get("Status") == "healthy", 300, info)
    TIMINGS["critic_swap_s"] = time.monotonic() - t0

    # The run finishes: the controller exits 0 after its last step.
    ctl = _container(info, "controller")
    t0 = time.monotonic()
    st = _wait("the controller to exit", lambda: (s := _state(ctl).get("State") or {}).get("Status") == "exited" and s,
               600, info, poll=2.0)
    TIMINGS["finish_s"] = time.monotonic() - t0
    assert st["ExitCode"] == 0, f"controller exited {st['ExitCode']}\n{_logs(info, 'controller', 'critic')}"
    rows = [json.loads(x) for x in (info["run_dir"] / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows][-1] == STEPS, rows[-1]

    # The critic checkpointed when it was stopped, and the one that came back serves the final
    # version (it reloaded that checkpoint and caught up).
    ckpt_dir = info["run_dir"] / "checkpoints" / "critic"
    saved = sorted(int(p.name[1:]) for p in ckpt_dir.glob("v*") if p.name[1:].isdigit())
    assert saved and saved[0] >= version_before, (version_before, saved)
    detail = _get_json(critic_url).get("detail") or {}
    assert int(detail.get("version", -1)) == STEPS, detail

    # Fleet metrics through the Prometheus container's query API.
    prom = f"http://127.0.0.1:{env['RLFLEET_PROMETHEUS_PORT']}/api/v1/query?" + urllib.parse.urlencode(
        {"query": "rlfleet_policy_version"})

    def versions() -> list[Any]:
        try:
            return list(_get_json(prom)["data"]["result"])
        except (urllib.error.URLError, OSError, KeyError, ValueError):
            return []

    result = _wait("rlfleet_policy_version in Prometheus", versions, 90, info, poll=2.0)
    by_service = {r["metric"].get("service"): float(r["value"][1]) for r in result}
    assert by_service, result
    assert max(by_service.values()) >= 1, by_service

    # The journal, audited from the host through the bind mount.
    audit = _run([sys.executable, "-m", "services.cli", "audit", "--run-dir", str(info["run_dir"]), "--finished"],
                 timeout=120, check=False)
    TIMINGS["test_s"] = time.monotonic() - t_all
    print("\ncompose timings: " + json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))
    # fleet.yaml holds the container's absolute run dir (/var/lib/rlfleet/run); the audit must follow
    # the directory it is given, wherever the volume is mounted now.
    assert audit.returncode == 0, f"rlfleet audit failed:\n{audit.stdout[-4000:]}\n{audit.stderr[-2000:]}"



def _rows_equal(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], tracker: str) -> None:
    assert sorted(got) == sorted(want), (tracker, sorted(got), sorted(want))
    for step, row in want.items():
        assert got[step] == row, (tracker, step, {k: (got[step].get(k), v) for k, v in row.items()
                                                  if got[step].get(k) != v})


@pytest.mark.timeout(1200)
def test_extras_images_train_a_reasoning_gym_task_through_lora_with_trackers(extras_stack: dict[str, Any]) -> None:
    info, env, base, run_dir = extras_stack, extras_stack["env"], extras_stack["base"], extras_stack["run_dir"]
    t_all = time.monotonic()

    # The extras images say what they hold; the base images hold none of it.
    for svc in (*EXTRAS_SERVICES, "prepare"):
        labels = {tag: json.loads(_run(["docker", "image", "inspect", f"rlfleet/{svc}:{tag}"], timeout=30).stdout)[0]
                  ["Config"]["Labels"].get("rlfleet.extras") for tag in ("extras", "local")}
        assert labels == {"extras": EXTRAS, "local": ""}, (svc, labels)
    sizes = {tag: int(_run(["docker", "image", "inspect", "-f", "{{.Size}}", f"rlfleet/actor:{tag}"],
                           timeout=30).stdout) for tag in ("local", "extras")}
    EXTRAS_TIMINGS["extras_added_mb"] = (sizes["extras"] - sizes["local"]) / 1e6

    # The base image's prepare refuses this config in one line that names the image to use.
    t0 = time.monotonic()
    p = _run(["docker", "run", "--rm", "--network", "none", "-v", f"{info['cfg_path']}:/etc/rlfleet/config.yaml:ro",
              "rlfleet/prepare:local", "--config", "/etc/rlfleet/config.yaml", "--run-dir", "/tmp/run",
              "--redis-url", "redis://127.0.0.1:1/0", "--no-models"], timeout=120, check=False)
    assert p.returncode == 2 and "scripts/docker_build.sh --extras" in p.stderr, (p.returncode, p.stderr[-2000:])
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    EXTRAS_TIMINGS["base_refuses_s"] = time.monotonic() - t0

    t0 = time.monotonic()
    p = _run([*base, "up", "-d"], env=env, timeout=600, check=False)
    if p.returncode != 0:
        ps = _run([*base, "ps"], env=env, timeout=60, check=False)
        raise AssertionError(f"compose up exited {p.returncode}: {p.stderr[-1500:]}\n{ps.stdout}\n{_logs(info)}")
    EXTRAS_TIMINGS["up_s"] = time.monotonic() - t0
    # GRPO with KL: the reference runs, the critic (profile `critic`) does not.
    assert not _run([*base, "ps", "-q", "critic"], env=env, timeout=60).stdout.split()
    for svc in EXTRAS_SERVICES:
        image = _state(_container(info, svc))["Config"]["Image"]
        assert image == f"rlfleet/{svc}:extras", (svc, image)

    ctl = _container(info, "controller")
    t0 = time.monotonic()
    st = _wait("the controller to exit", lambda: (s := _state(ctl).get("State") or {}).get("Status") == "exited" and s,
               600, info, poll=2.0)
    EXTRAS_TIMINGS["run_s"] = time.monotonic() - t0
    assert st["ExitCode"] == 0, f"controller exited {st['ExitCode']}\n{_logs(info, 'controller', 'actor')}"

    # The run: every step of the reasoning-gym task, scored and evaluated held-out.
    fleet = yaml.safe_load((run_dir / "fleet.yaml").read_text())
    assert (fleet["task"]["source"], fleet["task"]["name"]) == ("reasoning_gym", "chain_sum")
    want = expected_rows(run_dir)
    assert sorted(want) == list(range(1, EXTRAS_STEPS + 1)), sorted(want)
    assert "eval_accuracy" in want[EXTRAS_STEPS] and "kl_loss" in want[1], sorted(want[EXTRAS_STEPS])
    # The held-out problems are chain_sum's ("... problem: 15 - 43 - 75 ="), with its answers, scored
    # in the reward container as reasoning-gym's scorer does here (the last number written is the
    # answer; a wrong sign earns half).
    from reasoning_gym.utils import compute_decimal_reward

    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines() if x.strip()]
    assert {s["step"] for s in samples} == {0, EXTRAS_STEPS // 2, EXTRAS_STEPS}, sorted({s["step"] for s in samples})
    for s in samples:
        expr = s["prompt"].rsplit(":", 1)[1].strip().rstrip("=").strip()
        assert re.fullmatch(r"\d+( [+-] \d+){1,2}", expr), s["prompt"]
        assert int(s["answer"]) == eval(expr), s  # digits, + and - only
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", s["completion"])
        given = numbers[-1].rstrip(",") if numbers else None
        assert s["reward"] == compute_decimal_reward(given, oracle_answer=s["answer"], strip_commas=True), s

    # Every tracker holds every row, read back with its own reader, and none was disabled.
    t0 = time.monotonic()
    tb, tb_params = tensorboard_rows(run_dir / "tensorboard")
    _rows_equal(tb, want, "tensorboard")
    wb, wb_config, _ = wandb_rows(run_dir)
    _rows_equal(wb, want, "wandb")
    ml, ml_params, status = mlflow_rows(run_dir, f"file:{run_dir / 'mlruns'}", set(want[1]))
    _rows_equal(ml, want, "mlflow")
    assert status == "FINISHED"
    assert tb_params["task.name"] == "chain_sum" and ml_params["task.name"] == "chain_sum"
    assert wb_config["task"]["name"] == "chain_sum"
    state = read_state(run_dir)
    assert "disabled" not in state, state
    assert {n: t["rows"] for n, t in state["timing"].items()} == {t["kind"]: EXTRAS_STEPS for t in TRACKERS}
    EXTRAS_TIMINGS["read_trackers_s"] = time.monotonic() - t0

    # LoRA: the actor, stopped (SIGTERM: it drains and checkpoints), exits 0 and has checkpointed the
    # last version, adapters only; exported on the host (the volume mounted elsewhere), it is a
    # plain model directory of that version.
    from safetensors import safe_open

    actor = _container(info, "actor")
    t0 = time.monotonic()
    _run([*base, "stop", "-t", "120", "actor"], env=env, timeout=300)
    EXTRAS_TIMINGS["actor_stop_s"] = time.monotonic() - t0
    assert (_state(actor).get("State") or {}).get("ExitCode") == 0, _logs(info, "actor")
    ckpts = run_dir / "checkpoints" / "actor"
    assert (ckpts / "latest").read_text().strip() == f"v{EXTRAS_STEPS:08d}"
    with safe_open(str(ckpts / f"v{EXTRAS_STEPS:08d}" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys), keys[:5]
    out = run_dir.parent / "export"
    t0 = time.monotonic()
    _run([sys.executable, "-m", "services.cli", "export", "--run-dir", str(run_dir), "--out", str(out)], timeout=300)
    EXTRAS_TIMINGS["export_s"] = time.monotonic() - t0
    assert json.loads((out / "rlfleet_export.json").read_text())["version"] == EXTRAS_STEPS
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        merged = list(f.keys())
    assert merged and not any("lora_" in k for k in merged)

    audit = _run([sys.executable, "-m", "services.cli", "audit", "--run-dir", str(run_dir), "--finished"],
                 timeout=120, check=False)
    EXTRAS_TIMINGS["test_s"] = time.monotonic() - t_all
    print("\ncompose extras timings: " + json.dumps({k: round(v, 1) for k, v in EXTRAS_TIMINGS.items()}))
    assert audit.returncode == 0, f"rlfleet audit failed:\n{audit.stdout[-4000:]}\n{audit.stderr[-2000:]}"

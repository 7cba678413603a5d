"""Deployment files, checked without Docker: compose files in step with each other and with
`rlfleet plan`, the Dockerfile's targets, Prometheus and Grafana provisioning, the prepare step and
the container health check."""

from __future__ import annotations

import copy
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.core.config.run import SERVICE_NAMES, load_config, parse_config
from services.core.observability.metrics import METRIC_NAMES
from services.prepare import prepare, prometheus_targets

ROOT = Path(__file__).resolve().parents[2]
GPU_FILE = ROOT / "docker-compose.yml"
CPU_FILE = ROOT / "docker-compose.cpu.yml"
GPU_SERVICES = ("actor", "critic", "reward", "reference")


def _compose(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def test_cpu_file_is_the_gpu_file_without_gpu_reservations() -> None:
    gpu, cpu = _compose(GPU_FILE), _compose(CPU_FILE)
    stripped = copy.deepcopy(gpu)
    for svc in stripped["services"].values():
        svc.pop("deploy", None)
    assert cpu == stripped, "docker-compose.cpu.yml drifted from docker-compose.yml (beyond `deploy`)"
    assert not any("deploy" in s for s in cpu["services"].values())


def test_gpu_services_reserve_the_gpus_rlfleet_plan_assigns() -> None:
    services = _compose(GPU_FILE)["services"]
    for name in GPU_SERVICES:
        (dev,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        (ids,) = dev["device_ids"]
        assert ids.startswith(f"${{RLFLEET_{name.upper()}_GPUS:?"), ids
    assert "deploy" not in services["controller"]  # the slim image: no GPU


def test_every_variable_the_compose_files_need_from_the_plan_is_written_by_it(tmp_path: Path) -> None:
    from services.plan import plan_main

    env = tmp_path / "plan.env"
    empty = tmp_path / "inv.yaml"
    empty.write_text("gpus: []\n")
    assert plan_main(ROOT / "examples" / "tiny-cpu.yaml", env, False, empty) == 0
    written = {line.split("=", 1)[0] for line in env.read_text().splitlines() if line and not line.startswith("#")}
    for path in (GPU_FILE, CPU_FILE):
        planned = set(re.findall(r"\$\{(RLFLEET_[A-Z]+_GPUS)", path.read_text()))
        assert planned <= written, planned - written
    assert {"COMPOSE_PROFILES", "RLFLEET_CONFIG"} <= written


def test_services_share_host_network_run_dir_and_wait_for_redis_and_prepare() -> None:
    services = _compose(GPU_FILE)["services"]
    for name in SERVICE_NAMES:
        s = services[name]
        assert s["network_mode"] == "host", name
        assert s["depends_on"]["redis"] == {"condition": "service_healthy"}, name
        assert s["depends_on"]["prepare"] == {"condition": "service_completed_successfully"}, name
        assert any(v.endswith(":/var/lib/rlfleet/run") for v in s["volumes"]), name
        assert s["build"]["target"] == name and s["image"].startswith(f"rlfleet/{name}:")
        assert s["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?")
        assert s["restart"] in ("unless-stopped", "on-failure"), name
    assert services["controller"]["restart"] == "on-failure"  # exit 0 after the last step is final
    assert services["controller"]["depends_on"]["actor"] == {"condition": "service_healthy"}
    assert services["critic"]["profiles"] == ["critic"] and services["reference"]["profiles"] == ["reference"]
    assert services["grafana"]["profiles"] == ["dashboards"]
    assert services["prepare"]["restart"] == "no"
    # The controller and prepare are the slim (CPU) build; the others the GPU build.
    assert services["controller"]["build"]["args"]["BASE_IMAGE"].startswith("${RLFLEET_SLIM_BASE_IMAGE")
    assert services["actor"]["build"]["args"]["BASE_IMAGE"].startswith("${RLFLEET_GPU_BASE_IMAGE")


def test_redis_is_configured_for_streams() -> None:
    entry = (ROOT / "docker" / "redis-entry.sh").read_text()
    assert "appendonly yes" in entry and "maxmemory-policy noeviction" in entry
    assert "requirepass ${REDIS_PASSWORD}" in entry
    redis = _compose(GPU_FILE)["services"]["redis"]
    assert redis["network_mode"] == "host" and redis["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?")
    assert any(v.startswith("redis-data:") for v in redis["volumes"])


def _dockerfile_stages() -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {}
    current = None
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    for line in lines:
        line = line.strip()
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if m:
            current = m.group(1)
            stages[current] = []
        elif current and line and not line.startswith("#"):
            stages[current].append(line)
    return stages


def test_dockerfile_has_one_target_per_service_non_root_with_a_health_check() -> None:
    stages = _dockerfile_stages()
    for name in (*SERVICE_NAMES, "prepare"):
        body = stages[name]
        assert f'ENTRYPOINT ["python", "-m", "services.{name}"]' in body, name
    app = stages["app"]
    assert any(x.startswith("USER ${RLFLEET_UID}") for x in app)
    assert any(x.startswith("HEALTHCHECK") and "healthcheck.py" in x for x in app)
    # Layer order in the builder: torch, then dependencies from pyproject, and the source only later.
    builder = " ".join(stages["builder"])
    assert builder.index("TORCH_SPEC") < builder.index("COPY pyproject.toml") < builder.index("pip check")
    assert "COPY services/" not in builder
    assert (ROOT / "docker" / "wheels" / ".gitignore").exists()
    ignore = (ROOT / ".dockerignore").read_text()
    assert "*" in ignore.splitlines()  # the context is only what the build copies


def test_prometheus_scrapes_the_targets_prepare_writes() -> None:
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["honor_labels"] is True
    (sd,) = job["file_sd_configs"]
    assert sd["files"] == ["/var/lib/rlfleet/run/prometheus/targets.json"]
    mounts = _compose(GPU_FILE)["services"]["prometheus"]["volumes"]
    assert any(m.endswith(":/var/lib/rlfleet/run:ro") for m in mounts)
    cfg = load_config(ROOT / "examples" / "two-gpu.yaml")
    targets = prometheus_targets(cfg)
    assert [t["labels"]["service"] for t in targets] == cfg.services_needed()
    assert targets[0]["targets"] == [f"127.0.0.1:{cfg.endpoint('controller').http_port}"]


REQUIRED_PANEL_METRICS = {
    "rlfleet_tokens_total", "rlfleet_samples_total", "rlfleet_stage_latency_seconds_bucket",
    "rlfleet_queue_depth", "rlfleet_backpressure", "rlfleet_fill_ratio", "rlfleet_policy_version",
    "rlfleet_staleness", "rlfleet_gpu_utilization", "rlfleet_gpu_memory_bytes", "rlfleet_reward_mean", "rlfleet_kl",
}


def test_grafana_dashboard_has_the_panels_and_uses_only_exported_metrics() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "rlfleet.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    used = set(re.findall(r"\b(rlfleet_[a-z_]+)", " ".join(exprs)))
    assert used >= REQUIRED_PANEL_METRICS, REQUIRED_PANEL_METRICS - used
    exported = set(METRIC_NAMES) | {f"{m}_{s}" for m in METRIC_NAMES for s in ("bucket", "sum", "count")}
    assert used <= exported, used - exported
    assert any("histogram_quantile" in e for e in exprs)
    titles = {p["title"] for p in panels}
    for want in ("Tokens/s", "Samples/s", "Queue depth", "Policy version", "Staleness", "GPU utilization",
                 "GPU memory used", "Reward (mean)", "KL to reference"):
        assert want in titles
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    ds = yaml.safe_load((ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "rlfleet.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    assert all(p["datasource"]["uid"] == uid for p in panels)
    prov = yaml.safe_load((ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "rlfleet.yml").read_text())
    mount = next(v for v in _compose(GPU_FILE)["services"]["grafana"]["volumes"] if "dashboards:" in v)
    assert mount.split(":")[1] == prov["providers"][0]["options"]["path"]


def test_prepare_writes_fleet_yaml_and_targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    data["run"]["dir"] = str(tmp_path / "run")
    data["models"]["policy"] = {"path": str(tmp_path / "model")}
    data["services"] = {n: {"grpc_port": 0, "http_port": 0} for n in SERVICE_NAMES}
    monkeypatch.setenv("REDIS_PASSWORD", "x")
    out = prepare(parse_config(data), "redis://127.0.0.1:6390/0", password_env="REDIS_PASSWORD", build_models=False)
    fleet = load_config(tmp_path / "run" / "fleet.yaml")
    assert fleet == out
    assert fleet.redis.url == "redis://127.0.0.1:6390/0" and fleet.redis.password_env == "REDIS_PASSWORD"
    for n in fleet.services_needed():
        assert fleet.endpoint(n).grpc_port and fleet.endpoint(n).http_port
    targets = json.loads((tmp_path / "run" / "prometheus" / "targets.json").read_text())
    assert {t["labels"]["service"] for t in targets} == set(fleet.services_needed())
    # Again on the same run dir: the same ports (a restarted deployment resumes its run).
    again = prepare(load_config(tmp_path / "run" / "fleet.yaml"), None, build_models=False)
    assert again == fleet


@pytest.mark.parametrize("section,missing,needs", [
    ({"run": {"trackers": [{"kind": "tensorboard"}]}}, "tensorboard", "rlfleet[track]"),
    ({"task": {"source": "reasoning_gym", "name": "chain_sum", "params": {}, "eval_size": 8}}, "reasoning_gym",
     "reasoning-gym package"),
    ({"models": {"policy": {"build": {}, "lora": {"r": 4}}}}, "peft", "rlfleet[lora]"),
    ({"task": {"source": "jsonl", "path": "{tmp}/d.jsonl", "params": {}, "eval_size": 1}}, "datasets",
     "rlfleet[tasks]"),
])
def test_prepare_refuses_a_config_whose_extra_the_image_lacks_naming_the_image(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        section: dict[str, Any], missing: str, needs: str) -> None:
    import builtins
    import importlib.util

    from services.prepare import main

    data = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    for name, values in section.items():
        data[name].update(values)
    if data["task"].get("path"):
        data["task"]["path"] = data["task"]["path"].format(tmp=tmp_path)
        Path(data["task"]["path"]).write_text('{"prompt": "1 + 1 =", "answer": "2"}\n' * 4)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(data))
    find_spec, real_import = importlib.util.find_spec, builtins.__import__

    def no_find(name: str, *a: Any, **k: Any) -> Any:
        return None if name.split(".")[0] == missing else find_spec(name, *a, **k)

    def no_import(name: str, *a: Any, **k: Any) -> Any:
        if name.split(".")[0] == missing:
            raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
        return real_import(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", no_find)
    monkeypatch.setattr(builtins, "__import__", no_import)
    argv = ["--config", str(cfg), "--run-dir", str(tmp_path / "run"), "--redis-url", "redis://127.0.0.1:1/0",
            "--no-models"]
    monkeypatch.setenv("RLFLEET_IMAGE_EXTRAS", "")  # a base image
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needs in err and "scripts/docker_build.sh --extras" in err, err
    assert not (tmp_path / "run" / "fleet.yaml").exists()
    monkeypatch.delenv("RLFLEET_IMAGE_EXTRAS")  # not in an image: the package is named, no image
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needs in err and "docker_build" not in err, err


class _Ready(http.server.BaseHTTPRequestHandler):
    code = 200

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(self.code if self.path == "/readyz" else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def ready_server() -> Iterator[http.server.HTTPServer]:
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Ready)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()


def test_container_health_check_follows_readyz(tmp_path: Path, ready_server: http.server.HTTPServer) -> None:
    port = ready_server.server_address[1]
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(yaml.safe_dump({"services": {"actor": {"host": "0.0.0.0", "http_port": port}}}))
    env = dict(os.environ, RLFLEET_SERVICE="actor", RLFLEET_CONFIG=str(cfg))
    script = str(ROOT / "docker" / "healthcheck.py")
    assert subprocess.run([sys.executable, script], env=env, capture_output=True, timeout=30).returncode == 0
    _Ready.code = 503
    try:
        p = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=30)
        assert p.returncode == 1 and "not ready: 503" in p.stderr
    finally:
        _Ready.code = 200
    env["RLFLEET_SERVICE"] = "critic"
    assert subprocess.run([sys.executable, script], env=env, capture_output=True, timeout=30).returncode == 1


def test_scripts_parse() -> None:
    for script in ("docker_base.sh", "docker_engine.sh", "docker_build.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)
    for script in ("redis-entry.sh", "ensure_python.sh"):
        subprocess.run(["sh", "-n", str(ROOT / "docker" / script)], check=True)


EXTRAS_SCRIPT = ROOT / "docker" / "extras_requirements.py"


def _extras(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXTRAS_SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          check=False)


def test_the_extras_image_installs_the_extras_of_pyproject() -> None:
    import tomllib

    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    p = _extras("tasks,track,lora", str(ROOT / "pyproject.toml"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == optional["tasks"] + optional["track"] + optional["lora"]
    # An extra naming others (`rlfleet[tasks]`) is expanded, each requirement once.
    dev = _extras("dev", str(ROOT / "pyproject.toml")).stdout.split()
    assert not any(r.startswith("rlfleet[") for r in dev) and len(dev) == len(set(dev))
    assert set(optional["tasks"]) | set(optional["lora"]) | set(optional["track"]) <= set(dev)
    bad = _extras("tasks,trak", str(ROOT / "pyproject.toml"))
    assert bad.returncode == 2 and "no extra 'trak'" in bad.stderr and "track" in bad.stderr


def test_extras_built_from_source_are_read_from_pips_report(tmp_path: Path) -> None:
    report = {"install": [
        {"metadata": {"name": "pycosat", "version": "0.6.6"},
         "download_info": {"url": "https://files.example/pycosat-0.6.6.tar.gz#sha256=00"}},
        {"metadata": {"name": "peft", "version": "0.21.2"},
         "download_info": {"url": "https://files.example/peft-0.21.2-py3-none-any.whl#sha256=00"}},
        {"metadata": {"name": "zss", "version": "1.2.0"}, "download_info": {"url": "https://files.example/zss-1.2.0.zip"}},
    ]}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    p = _extras("--sdists", str(path))
    assert p.returncode == 0 and p.stdout.split() == ["pycosat==0.6.6", "zss==1.2.0"], (p.stdout, p.stderr)


def test_the_extras_are_one_layer_over_the_base_images() -> None:
    stages = _dockerfile_stages()
    # The base images' layers know nothing of EXTRAS: the builder never reads it, and in the app
    # stage it is declared only after the venv is copied, and before the source.
    assert not any("EXTRAS" in x for x in stages["builder"])
    app = stages["app"]
    venv = next(i for i, x in enumerate(app) if x.startswith("COPY --from=builder /opt/rlfleet"))
    arg = app.index("ARG EXTRAS=")
    source = next(i for i, x in enumerate(app) if x.startswith("COPY services/"))
    assert venv < arg < source
    install = next(x for x in app[arg:] if x.startswith("RUN") and "EXTRAS" in x)
    assert "-c /tmp/constraints.txt" in install and "pip check" in install and "--only-binary :all:" in install
    assert any(x.startswith("LABEL rlfleet.extras=") for x in app)
    # The compiler for source-only extras stays in the wheel stage.
    assert "gcc" in " ".join(stages["extras-wheels"]) and "gcc" not in " ".join(app)
    for path in (GPU_FILE, CPU_FILE):
        data = _compose(path)
        for anchor in ("x-gpu-build", "x-slim-build"):
            assert data[anchor]["args"]["EXTRAS"] == "${RLFLEET_EXTRAS:-}", (path.name, anchor)
    build = (ROOT / "scripts" / "docker_build.sh").read_text()
    assert 'RLFLEET_EXTRAS="${RLFLEET_EXTRAS:-tasks,track,lora}" RLFLEET_TAG="${RLFLEET_TAG:-extras}"' in build

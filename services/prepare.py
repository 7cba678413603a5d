"""`python -m services.prepare`: the one-shot init step of a container deployment.

`rlfleet up` resolves what every service must agree on (ports, Redis URL, model path, absolute run
directory) before it starts them. In Docker Compose or Kubernetes there is no launcher, so this
command does the same once, into the shared run directory, before any service starts:

    python -m services.prepare --config CONFIG --run-dir /var/lib/rlfleet/run \\
        --redis-url redis://127.0.0.1:6379/0

writes RUN_DIR/fleet.yaml (the config every service then reads), builds the tiny model when the
config asks for one (so services never race to build it), and writes
RUN_DIR/prometheus/targets.json (Prometheus file service discovery: one target per service HTTP
port). Running it again on the same run directory keeps the existing model and rewrites the files
identically: a restarted deployment resumes its run.

It first checks, as `rlfleet up` does, that the run's trackers, task and LoRA have their packages:
a config that needs an extra the image lacks (the base images have none; the extras images,
`scripts/docker_build.sh --extras`, have tasks, track and lora) fails here with one line naming it
and the image to use, before any service starts.

    python -m services.prepare wait --config RUN_DIR/fleet.yaml [--timeout S] -- CMD...

waits until every service the algorithm needs (except the controller) answers /readyz, then
replaces itself with CMD: the controller starts last, as under `rlfleet up`, whatever optional
stages (critic, reference) a compose file or manifest started.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from services.core.config.run import ConfigError, RunConfig, load_config, parse_config


def prometheus_targets(cfg: RunConfig) -> list[dict[str, Any]]:
    out = []
    for name in cfg.services_needed():
        ep = cfg.endpoint(name)
        host = "127.0.0.1" if ep.host in ("0.0.0.0", "::", "") else ep.host
        out.append({"targets": [f"{host}:{ep.http_port}"], "labels": {"service": name, "run": cfg.run.name}})
    return out


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare(cfg: RunConfig, redis_url: str | None, *, password_env: str | None = None,
            token_env: str | None = None, build_models: bool = True) -> RunConfig:
    """Resolve `cfg` into RUN_DIR/fleet.yaml (+ the model and the Prometheus targets)."""
    from services.fleet import resolve_fleet_config

    data = cfg.model_dump(mode="json")
    if password_env and not data["redis"].get("password_env"):
        data["redis"]["password_env"] = password_env
    if token_env and not data["security"].get("token_env"):
        data["security"]["token_env"] = token_env
    cfg = parse_config(data, source="prepare")
    check_packages(cfg)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    resolved = resolve_fleet_config(cfg, redis_url)
    if resolved.redis.url is None:
        raise ConfigError("redis.url is not set: pass --redis-url (or set redis.url in the config)")
    if build_models:
        from services.models.roles.resolve import prepare as prepare_models

        prepare_models(resolved)
    _write(resolved.run_dir / "fleet.yaml", yaml.safe_dump(resolved.model_dump(mode="json"), sort_keys=False))
    _write(resolved.run_dir / "prometheus" / "targets.json", json.dumps(prometheus_targets(resolved), indent=2))
    return resolved


def check_packages(cfg: RunConfig) -> None:
    """The optional packages the config needs are installed: its trackers, its task (built, so its
    parameters are checked too), peft for LoRA. Raises ConfigError with one line."""
    import importlib.util

    from services.core.observability.trackers import check_trackers
    from services.preflight import PreflightError, check_task

    check_trackers(cfg.run.trackers)
    try:
        check_task(cfg)
    except PreflightError as err:
        raise ConfigError(str(err)) from None
    except ModuleNotFoundError as err:  # a dataset source without `datasets`, math-verify rewards, ...
        raise ConfigError(f"task: needs the {err.name} package, which is not installed: pip install"
                          f" 'rlfleet[tasks]' (or change the task section of the config)") from None
    if cfg.models.policy.lora is not None and importlib.util.find_spec("peft") is None:
        raise ConfigError("models.policy.lora: LoRA needs the peft package: pip install 'rlfleet[lora]'")


def _image_hint(message: str) -> str:
    """In a base image (RLFLEET_IMAGE_EXTRAS set and empty), a missing package means the wrong image."""
    if os.environ.get("RLFLEET_IMAGE_EXTRAS") == "" and "package" in message:
        return (" (this image has none of the extras: run the extras images, built by"
                " `scripts/docker_build.sh --extras`, with RLFLEET_TAG=extras)")
    return ""


def _ready(cfg: RunConfig, name: str) -> bool:
    import httpx

    ep = cfg.endpoint(name)  # type: ignore[arg-type]
    host = "127.0.0.1" if ep.host in ("0.0.0.0", "::", "") else ep.host
    try:
        return httpx.get(f"http://{host}:{ep.http_port}/readyz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(cfg: RunConfig, timeout_s: float, exclude: Sequence[str] = ("controller",)) -> list[str]:
    """Wait until the needed services answer /readyz; returns those still not ready at the deadline."""
    waiting: list[str] = [n for n in cfg.services_needed() if n not in exclude]
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        waiting = [n for n in waiting if not _ready(cfg, n)]
        if waiting:
            time.sleep(0.5)
    return waiting


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "wait":
        return _main_wait(argv[1:])
    p = argparse.ArgumentParser(prog="python -m services.prepare",
                                description="Write RUN_DIR/fleet.yaml for a container deployment (see module doc).")
    p.add_argument("--config", required=True, help="run config (YAML)")
    p.add_argument("--run-dir", default=None, help="override run.dir (the shared volume)")
    p.add_argument("--max-steps", type=int, default=None, help="override run.max_steps")
    p.add_argument("--redis-url", default=os.environ.get("RLFLEET_REDIS_URL") or None,
                   help="Redis every service uses (default $RLFLEET_REDIS_URL or redis.url)")
    p.add_argument("--password-env", default=None,
                   help="name of the env var holding the Redis password, when the config names none"
                        " (default REDIS_PASSWORD when that variable is set)")
    p.add_argument("--token-env", default=None,
                   help="name of the env var holding the fleet token, when the config names none"
                        " (default RLFLEET_TOKEN when that variable is set)")
    p.add_argument("--no-models", action="store_true", help="do not build the tiny model here")
    args = p.parse_args(argv)
    from services.core.serving.entry import quiet_torch

    quiet_torch()
    password_env = args.password_env or ("REDIS_PASSWORD" if os.environ.get("REDIS_PASSWORD") else None)
    token_env = args.token_env or ("RLFLEET_TOKEN" if os.environ.get("RLFLEET_TOKEN") else None)
    try:
        cfg = load_config(args.config, run__dir=args.run_dir, run__max_steps=args.max_steps)
        out = prepare(cfg, args.redis_url, password_env=password_env, token_env=token_env,
                      build_models=not args.no_models)
    except ConfigError as err:
        print(f"prepare: {err}{_image_hint(str(err))}", file=sys.stderr)
        return 2
    ports = ", ".join(f"{n} grpc {out.endpoint(n).grpc_port} http {out.endpoint(n).http_port}"
                      for n in out.services_needed())
    print(f"prepare: wrote {out.run_dir / 'fleet.yaml'} (services: {ports}; redis {out.redis.url})")
    return 0


def _main_wait(argv: list[str]) -> int:
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m services.prepare wait")
    p.add_argument("--config", default=os.environ.get("RLFLEET_CONFIG", "/var/lib/rlfleet/run/fleet.yaml"))
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    while not Path(args.config).is_file():  # prepare may still be writing it
        if time.monotonic() > deadline:
            print(f"wait: {args.config} did not appear within {args.timeout:.0f}s", file=sys.stderr)
            return 1
        time.sleep(0.5)
    try:
        cfg = load_config(args.config)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    left = wait_ready(cfg, max(1.0, deadline - time.monotonic()))
    if left:
        print(f"wait: not ready after {args.timeout:.0f}s: {', '.join(left)}", file=sys.stderr)
        return 1
    print(f"wait: ready: {', '.join(n for n in cfg.services_needed() if n != 'controller')}", flush=True)
    if cmd:
        os.execvp(cmd[0], cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())

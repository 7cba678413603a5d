"""The `rlfleet` command.

Every failure a user can cause or fix ends as one line on stderr naming the problem and the fix,
and a non-zero exit; the traceback goes to RUN_DIR/logs/rlfleet.log (service tracebacks stay in
each service's own log). Nothing slow (torch, a service) starts before the pre-flight checks pass.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.resources
import json
import logging
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: a Ctrl-C in an import before main() runs is a traceback
    from services.core.config.run import RunConfig

log = logging.getLogger("rlfleet.cli")
_T0 = time.monotonic()  # about when the command started: the launcher log's seconds count from here

# The run directory of the command being run, once known: where the traceback of a failure goes.
_run_dir: Path | None = None


def default_config() -> str:
    """The packaged tiny CPU config: `--config` works from any directory without it."""
    return str(importlib.resources.files("services") / "examples" / "tiny-cpu.yaml")


def _version() -> str:
    try:
        return importlib.metadata.version("rlfleet")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def load_config(*args: Any, **kw: Any) -> RunConfig:
    from services.core.config.run import load_config

    return load_config(*args, **kw)


def _load(args: argparse.Namespace) -> RunConfig:
    global _run_dir
    cfg = load_config(
        args.config,
        run__max_steps=getattr(args, "max_steps", None),
        run__dir=getattr(args, "run_dir", None),
    )
    _run_dir = cfg.run_dir
    return cfg


def _cmd_train(args: argparse.Namespace) -> int:
    if not args.local:
        print("rlfleet train runs the single-process loop and needs --local; use `rlfleet up` for the fleet",
              file=sys.stderr)
        return 2
    from services.preflight import check_local

    cfg = _load(args)
    state = check_local(cfg)
    if state.kind == "local" and state.step:
        print(f"{cfg.run_dir} holds an earlier local run ({state.step} steps): train --local starts over")
    from services.core.serving.entry import quiet_torch
    from services.local import run_local

    quiet_torch()
    if not sys.stdout.isatty():
        from services.progress import ProgressLine

        line = ProgressLine("train --local", cfg.run.max_steps, every_s=args.progress_every)

        def on_step(row: dict[str, float]) -> None:
            line.update(int(row["step"]), _row_info(row))

        path = run_local(cfg, on_step=on_step)
        print(f"metrics: {path}")
        return 0
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]train --local[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"), transient=False,
    ) as bar:
        task = bar.add_task("steps", total=cfg.run.max_steps, info="building models")
        path = run_local(cfg, on_step=lambda row: bar.update(task, completed=int(row["step"]), info=_row_info(row)))
    print(f"metrics: {path}")
    return 0


def _row_info(row: dict[str, Any]) -> str:
    info = f"reward {row.get('reward_mean', float('nan')):.3f}"
    if "kl" in row:
        info += f"  kl {row['kl']:.4f}"
    if "policy_loss" in row:
        info += f"  loss {row['policy_loss']:+.4f}"
    info += f"  {row.get('tokens_per_s', 0):.0f} tok/s"
    if "eval_reward" in row:
        info += f"  eval {row['eval_reward']:.3f}"
    return info


def _fleet_table(status: dict[str, Any], cfg: RunConfig) -> Any:
    from rich.table import Table

    ctl = status.get("controller", {}).get("detail", {}) or {}
    last = ctl.get("last", {})
    title = f"rlfleet {cfg.run.name} — step {ctl.get('step', 0)}/{cfg.run.max_steps}"
    if last:
        title += f"  reward {last.get('reward_mean', float('nan')):.3f}"
        if "kl" in last:
            title += f"  kl {last['kl']:.4f}"
        title += f"  {last.get('tokens_per_s', 0):.0f} tok/s"
    t = Table(title=title)
    for col in ("service", "pid", "state", "version", "restarts", "detail"):
        t.add_column(col)
    for name, row in status.items():
        detail = row.get("detail", {}) or {}
        extra = ", ".join(f"{k}={v}" for k, v in detail.items()
                          if k in ("in_flight", "dropped", "handled", "fill_ratio", "backpressure", "admission_open"))
        t.add_row(name, str(row.get("pid", "")), str(row.get("state", "")),
                  str(detail.get("version", row.get("version", ""))), str(row.get("restarts", 0)), extra)
    return t


def _cmd_up(args: argparse.Namespace) -> int:
    from rich.console import Console

    from services.fleet import INTERRUPT_GRACE_S, STARTUP_GRACE_S, Fleet

    cfg = _load(args)
    console = Console()
    fleet = Fleet(cfg, restart_budget=args.restart_budget)
    # From here on SIGINT and SIGTERM stop the launcher and everything it started, at any moment.
    with fleet.stop_on_signals():
        try:
            return _up(fleet, cfg, args, console)
        except KeyboardInterrupt as err:  # Interrupted, or a Ctrl-C that came before the handler
            return _interrupted(getattr(err, "signum", signal.SIGINT))
        except Exception as err:
            if fleet.stop_signal is None:
                raise
            # A library turned the interrupt into an error of its own (a module half imported): the
            # user asked to stop, and the fleet stops; the traceback goes to the log only.
            _keep_traceback("up", err)
            return _interrupted(fleet.stop_signal)
        finally:
            interrupted = fleet.stop_signal is not None
            fleet.stop(grace_s=30.0 if not interrupted else INTERRUPT_GRACE_S if fleet.ready else STARTUP_GRACE_S)
            if fleet.procs:  # a report only for a run that started; never in place of the real error
                with fleet.hold_signals():  # matplotlib's import, like torch's, is not to be interrupted
                    _report(fleet, cfg, console, interrupted)


def _up(fleet: Any, cfg: RunConfig, args: argparse.Namespace, console: Any) -> int:
    cfg.check_secrets()  # before anything starts: a configured secret that is missing fails closed
    state = fleet.preflight()  # nothing started yet: a failure here leaves nothing to stop
    from services.core.observability.logs import log_to_file

    # Where start-up goes, next to the services' logs: preflight, Redis, models, each service started.
    log_to_file(fleet.run_dir / "logs" / "launcher.log", "launcher")
    log.info("preflight passed", extra={"seconds": round(time.monotonic() - _T0, 2), "step": state.step})
    if state.step >= cfg.run.max_steps:
        print(f"run already finished ({state.step} steps) in {fleet.run_dir}; use --max-steps to extend")
        return 0
    if state.step:
        console.print(f"[bold]rlfleet up[/]: resuming {cfg.run.name} from step {state.step} of {cfg.run.max_steps}"
                      f" in {fleet.run_dir}")
    else:
        console.print(f"[bold]rlfleet up[/]: preparing {cfg.run.name} in {fleet.run_dir}")
    fleet.reserve_ports()  # before anything binds one: a taken port is a one-second failure
    fleet.start_zygote()  # the services' torch loads in it meanwhile (services.prefork)
    # No torch here for a policy given by path: importing it put 5-6 s between the preflight and
    # Redis on every start on the GPU host (2026-12-07), all of it before the first step. A policy to
    # build imports it in prepare (under hold_signals); a stop during the services' start-up is
    # bounded by STARTUP_HARD_EXIT_S, which the 2026-12-02 CI failure that once kept it here predates.
    fleet.prepare()
    fleet.start(ready_timeout_s=args.ready_timeout)
    log.info("all services ready", extra={"seconds": round(time.monotonic() - _T0, 2)})
    assert fleet.cfg is not None
    console.print(f"all services ready: {', '.join(fleet.procs)}; logs in {fleet.run_dir / 'logs'}")
    code = _supervise(fleet, console, args.progress_every)
    console.print(f"run finished: metrics {fleet.run_dir / 'metrics.jsonl'}")
    if code == 0:
        fleet.stop()  # the actor checkpoints its final version as it drains; the export reads it
        fleet.check_stop()
        from services.core.serving.entry import quiet_torch

        with fleet.hold_signals():  # the export's torch import, the launcher's first: not to be interrupted
            quiet_torch()  # and no progress bars from transformers in the user's console
        code = _export_final(fleet.run_dir, console)
    return code


def _interrupted(signum: int) -> int:
    """The one line for a launcher stopped by a signal; its exit code is the shell's 128 + signal."""
    from services.fleet import stop_line

    print(f"{stop_line(signum)}: stopping the fleet", file=sys.stderr)
    return 128 + signum


def _report(fleet: Any, cfg: RunConfig, console: Any, interrupted: bool) -> None:
    from services.report import write_report

    try:
        console.print(f"report: {write_report(fleet.run_dir, title=f'rlfleet {cfg.run.name}')}")
    except OSError as err:
        log.warning("report not written: %s", err)
    except Exception:
        if not interrupted:
            raise
        # After an interrupt a library the report needs may be half imported (see Fleet.stop_on_signals).
        log.warning("report not written after a stop signal", exc_info=True)


def _export_final(run_dir: Path, console: Any) -> int:
    """The trained policy as a save_pretrained directory, RUN_DIR/export, at the end of a run."""
    from services.models.checkpoints.export import ExportError, export_final

    try:
        done = export_final(run_dir)
    except (ExportError, OSError, ValueError) as err:
        log.error("final export failed", exc_info=True)
        print(f"rlfleet up: the run finished but its final export failed: {err}", file=sys.stderr)
        return 1
    console.print(f"exported version {done.version} to {done.out}")
    return 0


def _supervise(fleet: Any, console: Any, progress_every: float) -> int:
    cfg = fleet.cfg
    if not console.is_terminal:
        # Logs, CI, `nohup`: a plain line every few seconds instead of a live table nobody sees.
        from services.progress import ProgressLine

        line = ProgressLine(f"rlfleet {cfg.run.name}", cfg.run.max_steps, every_s=progress_every)

        def tick(st: dict[str, Any]) -> None:
            ctl = st.get("controller", {}).get("detail", {}) or {}
            if "step" in ctl:  # nothing while the controller is unreachable (starting, or just finished)
                line.update(int(ctl["step"]), _row_info(ctl["last"]) if ctl.get("last") else "")

        return int(fleet.supervise(on_tick=tick))
    from rich.live import Live

    with Live(_fleet_table({}, cfg), console=console, refresh_per_second=2) as live:
        return int(fleet.supervise(on_tick=lambda st: live.update(_fleet_table(st, cfg))))


def _cmd_status(args: argparse.Namespace) -> int:
    import httpx

    from services.fleet import read_service_files

    global _run_dir
    run_dir = _run_dir = Path(args.run_dir) if args.run_dir else load_config(args.config).run_dir
    files = read_service_files(run_dir)
    if not files:
        print(f"no services found in {run_dir / 'services'}", file=sys.stderr)
        return 1
    out: dict[str, Any] = {}
    for name, info in files.items():
        row = dict(info)
        try:
            row.update(httpx.get(f"http://{info['host']}:{info['http_port']}/v1/status", timeout=1.0).json())
        except (httpx.HTTPError, KeyError, ValueError):
            row["state"] = "unreachable"
        out[name] = row
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        for name, row in out.items():
            detail = row.get("detail") or {}
            print(f"{name:<12} pid={row.get('pid')} state={row.get('state')} "
                  f"grpc={row.get('host')}:{row.get('grpc_port')} http={row.get('http_port')} "
                  f"version={detail.get('version', '')} {json.dumps(detail, default=str)}")
            for rep in detail.get("engine_replicas", []):  # generation.replicas > 1: one line per engine
                gpus = ",".join(str(g["gpu"]) for g in rep.get("gpus", [])) or "-"
                print(f"{'':<12} replica {rep['replica']} pid={rep.get('pid')} alive={rep.get('alive')}"
                      f" version={rep.get('version')} {rep.get('tokens_per_s', 0):.0f} tok/s gpus={gpus}"
                      f" weights={rep.get('weight_transfer', '-')}")
    return 0


def _cmd_swap(args: argparse.Namespace) -> int:
    from services.swap import swap

    global _run_dir
    run_dir = _run_dir = Path(args.run_dir) if args.run_dir else load_config(args.config).run_dir
    token = load_config(args.config).token() if args.config else None
    t = swap(run_dir, args.service, token=token, timeout_s=args.timeout)
    print(f"{args.service}: pid {int(t['old_pid'])} drained in {t['drain_s']:.1f}s; "
          f"pid {int(t['new_pid'])} ready {t['replacement_ready_s']:.1f}s later")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from services.plan import plan_main

    return plan_main(Path(args.config), Path(args.out) if args.out else None, args.json,
                     Path(args.inventory) if args.inventory else None,
                     Path(args.k8s_patch) if args.k8s_patch else None)


def _cmd_audit(args: argparse.Namespace) -> int:
    from services.audit import audit_main

    finished = True if args.finished else False if args.running else None
    return audit_main(Path(args.run_dir), finished=finished, json_out=args.json)


def _cmd_export(args: argparse.Namespace) -> int:
    from services.core.serving.entry import quiet_torch
    from services.models.checkpoints.export import export_main

    quiet_torch()
    return export_main(args.run_dir, args.out, version=args.version, base=args.base, lora=args.lora)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlfleet", description="RL post-training as a fleet of services")
    p.add_argument("--version", action="version", version=f"rlfleet {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    config_help = "run config (YAML); default: the packaged tiny CPU config"

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", default=default_config(), help=config_help)
        sp.add_argument("--max-steps", type=int, default=None, help="override run.max_steps")
        sp.add_argument("--run-dir", default=None, help="override run.dir")
        sp.add_argument("--progress-every", type=float, default=5.0, metavar="S",
                        help="seconds between progress lines when the output is not a terminal")

    t = sub.add_parser("train", help="train in one process (the reference loop)")
    common(t)
    t.add_argument("--local", action="store_true", help="run every role in this process, no services")
    t.set_defaults(fn=_cmd_train)

    u = sub.add_parser("up", help="start Redis and every service as its own process, and run to the end")
    common(u)
    u.add_argument("--restart-budget", type=int, default=3, help="restarts allowed per service")
    u.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for services to be ready")
    u.set_defaults(fn=_cmd_up)

    st = sub.add_parser("status", help="report a running fleet")
    st.add_argument("--config", default=default_config(), help=config_help)
    st.add_argument("--run-dir", default=None)
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=_cmd_status)

    sw = sub.add_parser("swap", help="hot-swap one service of a running local fleet (drain, replace, ready)")
    sw.add_argument("service", choices=["actor", "critic", "reward", "reference"])
    sw.add_argument("--config", default=None, help="run config (for run.dir and the token)")
    sw.add_argument("--run-dir", default=None)
    sw.add_argument("--timeout", type=float, default=180.0)
    sw.set_defaults(fn=_cmd_swap)

    pl = sub.add_parser("plan", help="place device groups on this host's GPUs; write the env file docker compose reads")
    pl.add_argument("--config", default=default_config(), help=config_help)
    pl.add_argument("--out", default=None, help="write the env file here (docker compose --env-file FILE)")
    pl.add_argument("--inventory", default=None,
                    help="GPUs from a YAML/JSON file instead of NVML (plan for another host)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--k8s-patch", default=None,
                    help="write a kustomize patch with each Deployment's nvidia.com/gpu count here")
    pl.set_defaults(fn=_cmd_plan)

    a = sub.add_parser("audit", help="check a run against the five invariants of the task journal")
    a.add_argument("--run-dir", required=True)
    a.add_argument("--json", action="store_true")
    g = a.add_mutually_exclusive_group()
    g.add_argument("--finished", action="store_true", help="treat the run as finished (in-flight tasks are lost)")
    g.add_argument("--running", action="store_true", help="treat the run as still going")
    a.set_defaults(fn=_cmd_audit)

    ex = sub.add_parser("export", help="write a run's trained policy as a save_pretrained directory with its tokenizer")
    ex.add_argument("--run-dir", required=True)
    ex.add_argument("--out", required=True, help="a new (or empty) directory")
    ex.add_argument("--version", type=int, default=None, help="the actor checkpoint version (default: the latest)")
    ex.add_argument("--base", default=None,
                    help="the model directory the run started from (default: RUN_DIR/fleet.yaml's or RUN_DIR/models)")
    ex.add_argument("--lora", choices=["merged", "adapter"], default="merged",
                    help="a LoRA run's export: the base with the adapters merged (default) or the peft adapter dir")
    ex.set_defaults(fn=_cmd_export)
    return p


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message is already the one line a user needs. Only from modules this
    command imported: an error cannot come from a module that was never loaded (and importing
    one here, like the model loader, would cost seconds of torch start-up)."""
    names = {
        "services.preflight": ("PreflightError",), "services.core.host.ports": ("PortError",),
        "services.fleet": ("FleetError",), "services.tasks.base": ("TaskError",),
        "services.models.io.loading": ("ModelLoadError",), "services.core.host.redis_proc": ("RedisNotFound",),
        "services.core.host.placement": ("PlacementError",), "services.core.journal.journal": ("JournalError",),
        "services.rl.dynamic_sampling": ("DynamicSamplingExhausted",),
    }
    out: list[type[BaseException]] = []
    for module, classes in names.items():
        mod = sys.modules.get(module)
        out += [getattr(mod, c) for c in classes if mod is not None and hasattr(mod, c)]
    return tuple(out)


def _keep_traceback(cmd: str, err: BaseException) -> Path | None:
    """Append the traceback to RUN_DIR/logs/rlfleet.log (a temp file when that is not writable)."""
    text = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} rlfleet {cmd}: " + "".join(
        traceback.format_exception(type(err), err, err.__traceback__))
    candidates = [_run_dir / "logs" / "rlfleet.log"] if _run_dir is not None else []
    candidates.append(Path(tempfile.gettempdir()) / "rlfleet-cli.log")
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for h in logging.getLogger().handlers:
        h.setLevel(logging.WARNING)  # `up` also logs INFO, to RUN_DIR/logs/launcher.log only
    try:
        from services.core.config.run import ConfigError  # inside: a Ctrl-C during this import is one line too
        from services.core.serving.entry import compile_caches

        compile_caches()  # `train --local` compiles in this process; `up`'s services inherit it

        try:
            return int(args.fn(args))
        except ConfigError as err:
            print(str(err), file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        where = _keep_traceback(args.cmd, err)
        first = (str(err).strip().splitlines() or [""])[0]
        if isinstance(err, _user_errors()):
            print(f"rlfleet {args.cmd}: {first}", file=sys.stderr)
            return 1
        if isinstance(err, OSError) and err.strerror:
            print(f"rlfleet {args.cmd}: {err.strerror}: {err.filename or first}", file=sys.stderr)
            return 1
        hint = f" (traceback in {where})" if where else ""
        print(f"rlfleet {args.cmd}: unexpected {type(err).__name__}: {first}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""The `rlfleet` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.core.config import ConfigError, RunConfig, load_config


def _load(args: argparse.Namespace) -> RunConfig:
    return load_config(
        args.config,
        run__max_steps=getattr(args, "max_steps", None),
        run__dir=getattr(args, "run_dir", None),
    )


def _cmd_train(args: argparse.Namespace) -> int:
    if not args.local:
        print("rlfleet train runs the single-process loop and needs --local; use `rlfleet up` for the fleet",
              file=sys.stderr)
        return 2
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from services.local import run_local

    cfg = _load(args)
    with Progress(
        TextColumn("[bold]train --local[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"), transient=False,
    ) as bar:
        task = bar.add_task("steps", total=cfg.run.max_steps, info="building models")

        def on_step(row: dict[str, float]) -> None:
            info = f"reward {row['reward_mean']:.3f}"
            if "kl" in row:
                info += f"  kl {row['kl']:.4f}"
            info += f"  loss {row.get('policy_loss', 0.0):+.4f}  {row['tokens_per_s']:.0f} tok/s"
            if "eval_reward" in row:
                info += f"  eval {row['eval_reward']:.3f}"
            bar.update(task, completed=int(row["step"]), info=info)

        path = run_local(cfg, on_step=on_step)
    print(f"metrics: {path}")
    return 0


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
                          if k in ("in_flight", "handled", "fill_ratio", "backpressure", "admission_open"))
        t.add_row(name, str(row.get("pid", "")), str(row.get("state", "")),
                  str(detail.get("version", row.get("version", ""))), str(row.get("restarts", 0)), extra)
    return t


def _cmd_up(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from services.fleet import Fleet, FleetError
    from services.report import write_report

    cfg = _load(args)
    console = Console()
    fleet = Fleet(cfg, restart_budget=args.restart_budget)
    code = 1
    try:
        console.print(f"[bold]rlfleet up[/]: preparing {cfg.run.name} in {cfg.run_dir}")
        fleet.prepare()
        fleet.start(ready_timeout_s=args.ready_timeout)
        assert fleet.cfg is not None
        console.print(f"all services ready: {', '.join(fleet.procs)}; logs in {fleet.run_dir / 'logs'}")
        with Live(_fleet_table({}, fleet.cfg), console=console, refresh_per_second=2,
                  transient=not console.is_terminal) as live:
            code = fleet.supervise(on_tick=lambda st: live.update(_fleet_table(st, fleet.cfg)))  # type: ignore[arg-type]
        console.print(f"run finished: metrics {fleet.run_dir / 'metrics.jsonl'}")
    except FleetError as err:
        console.print(f"[red]fleet error:[/] {err}")
        code = 1
    except KeyboardInterrupt:
        console.print("interrupted: stopping the fleet")
        code = 130
    finally:
        fleet.stop()
        report = write_report(fleet.run_dir, title=f"rlfleet {cfg.run.name}")
        console.print(f"report: {report}")
    return code


def _cmd_status(args: argparse.Namespace) -> int:
    import httpx

    from services.fleet import read_service_files

    run_dir = Path(args.run_dir) if args.run_dir else load_config(args.config).run_dir
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
    return 0


def _cmd_swap(args: argparse.Namespace) -> int:
    from services.fleet import FleetError, swap

    run_dir = Path(args.run_dir) if args.run_dir else load_config(args.config).run_dir
    token = load_config(args.config).token() if args.config else None
    try:
        t = swap(run_dir, args.service, token=token, timeout_s=args.timeout)
    except FleetError as err:
        print(f"swap failed: {err}", file=sys.stderr)
        return 1
    print(f"{args.service}: pid {int(t['old_pid'])} drained in {t['drain_s']:.1f}s; "
          f"pid {int(t['new_pid'])} ready {t['replacement_ready_s']:.1f}s later")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from services.plan import plan_main

    return plan_main(Path(args.config), Path(args.out) if args.out else None, args.json,
                     Path(args.inventory) if args.inventory else None)


def _cmd_audit(args: argparse.Namespace) -> int:
    from services.audit import audit_main

    finished = True if args.finished else False if args.running else None
    return audit_main(Path(args.run_dir), finished=finished, json_out=args.json)


def _cmd_export(args: argparse.Namespace) -> int:
    from services.models.export import export_main

    return export_main(args.run_dir, args.out, version=args.version, base=args.base)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlfleet", description="RL post-training as a fleet of services")
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", default="examples/tiny-cpu.yaml", help="run config (YAML)")
        sp.add_argument("--max-steps", type=int, default=None, help="override run.max_steps")
        sp.add_argument("--run-dir", default=None, help="override run.dir")

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
    st.add_argument("--config", default="examples/tiny-cpu.yaml")
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
    pl.add_argument("--config", default="examples/tiny-cpu.yaml", help="run config (YAML)")
    pl.add_argument("--out", default=None, help="write the env file here (docker compose --env-file FILE)")
    pl.add_argument("--inventory", default=None,
                    help="GPUs from a YAML/JSON file instead of NVML (plan for another host)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
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
    ex.set_defaults(fn=_cmd_export)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd in ("train", "up", "export"):
        from services.core.entry import quiet_torch

        quiet_torch()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        return int(args.fn(args))
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

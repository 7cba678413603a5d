"""The `rlfleet` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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

"""`python -m services.<name> --config FILE`: the one way every service process starts."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from services.core.config import ConfigError, RunConfig, load_config
from services.core.logs import setup_logging


def service_main(name: str, serve: Callable[[RunConfig], None]) -> None:
    p = argparse.ArgumentParser(prog=f"python -m services.{name}")
    p.add_argument("--config", required=True, help="run config (YAML); `rlfleet up` writes RUN_DIR/fleet.yaml")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    setup_logging(name, args.log_level)
    try:
        cfg = load_config(args.config)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        sys.exit(2)
    if cfg.redis.url is None:
        logging.getLogger("rlfleet").error("redis.url is not set; start services with `rlfleet up`, "
                                           "or set redis.url in the config")
        sys.exit(2)
    serve(cfg)

"""`python -m services.<name> --config FILE`: the one way every service process starts."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from services.core.config.run import ConfigError, RunConfig, load_config
from services.core.host import lifeline
from services.core.observability.logs import setup_logging

Serve = Callable[[RunConfig], None]


def torch_threads() -> int:
    """Intra-op threads per service process (RLFLEET_TORCH_THREADS, default 1); an engine's child
    process takes the same."""
    return int(os.environ.get("RLFLEET_TORCH_THREADS", "1"))


def quiet_torch() -> None:
    """One intra-op thread per process unless RLFLEET_TORCH_THREADS says otherwise: several services
    share the host's cores, and on small models extra threads cost more than they give (measured on
    2 cores: generation 44x slower with 2 threads per process). Also silence transformers' progress
    bars, which are not structured logs."""
    import torch
    import transformers

    torch.set_num_threads(torch_threads())
    transformers.utils.logging.disable_progress_bar()


def compile_caches() -> None:
    """Inductor's compiled kernels in the user's cache directory ($XDG_CACHE_HOME or ~/.cache, under
    rlfleet/inductor) rather than torch's default /tmp/torchinductor_<user>, which a reboot or a tmp
    cleaner empties: a later run on the host loads its kernels instead of compiling them again (the
    trainer's cold compile is ~60 s at 0.5B). vLLM keeps its graphs in ~/.cache/vllm already. A value
    the user set wins; an unwritable home leaves torch's default."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlfleet" / "inductor"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)


def service_main(name: str, serve: Serve | str, *, prestart: Callable[[RunConfig], None] | None = None) -> None:
    """Parse the arguments, set up logging, load and check the config, then run `serve(cfg)`.

    `serve` may be named as "module:function", imported only once the config is valid, after
    `prestart(cfg)`: what `prestart` starts (the actor's engine process) then runs while this process
    imports torch and the service (`services.models.engines.boot`)."""
    lifeline.watch_launcher()  # first: a launcher killed while this process starts takes it down too
    compile_caches()  # before anything imports torch
    p = argparse.ArgumentParser(prog=f"python -m services.{name}")
    p.add_argument("--config", required=True, help="run config (YAML); `rlfleet up` writes RUN_DIR/fleet.yaml")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--replica", type=int, default=0,
                   help="run as extra replica K of a stateless scorer: same consumer group, free ports")
    args = p.parse_args()
    setup_logging(name, args.log_level)
    try:
        cfg = load_config(args.config)
        cfg.check_secrets()
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        sys.exit(2)
    if cfg.redis.url is None:
        logging.getLogger("rlfleet").error("redis.url is not set; start services with `rlfleet up`, "
                                           "or set redis.url in the config")
        sys.exit(2)
    if prestart is not None:
        prestart(cfg)
    if isinstance(serve, str):
        module, _, attr = serve.partition(":")
        serve = getattr(importlib.import_module(module), attr)
        assert callable(serve), f"{module}:{attr} is not callable"
    if "torch" in sys.modules:  # a service that runs no model (a reward function) never imports it
        quiet_torch()
    if args.replica:
        ep = cfg.endpoint(name).model_copy(update={"grpc_port": 0, "http_port": 0})  # type: ignore[arg-type]
        cfg = cfg.model_copy(update={"services": {**cfg.services, name: ep}})
        os.environ["RLFLEET_INSTANCE"] = f"{name}-{args.replica}"
    try:
        serve(cfg)
    except ConfigError as err:  # found while building the service (e.g. a journal of another run)
        print(f"{name}: {err}", file=sys.stderr)
        sys.exit(2)
    except Exception as err:
        # One structured record with the traceback: the launcher reports its last line, the log keeps all.
        logging.getLogger("rlfleet").error("%s failed: %s: %s", name, type(err).__name__, err, exc_info=True)
        sys.exit(1)

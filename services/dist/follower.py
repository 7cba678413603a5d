"""A follower rank: joins rank 0's process group, receives the run's config, builds the same
sharded trainer and runs every command rank 0 announces until STOP or rank 0's death.

Started by `spawn` (from `group.RankGroup` on rank 0's host, from `node` on a worker host) as
`python -m services.dist.follower --service S --rank R --world N --port P`; never by hand. Any
failure exits non-zero, which fails the whole service. Followers die with the process that started
them (PR_SET_PDEATHSIG), so a killed service or node leaves no orphans."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from services.core.config.run import RunConfig
from services.dist.protocol import Op, RankError, receive

log = logging.getLogger("rlfleet.dist.follower")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. The signal fires when the thread that forked exits,
    # so followers are started from the main thread, which lives as long as their parent.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(service: str, rank: int, local_rank: int, world: int, host: str, port: int, backend: str,
          timeout_s: float) -> subprocess.Popen[bytes]:
    """One follower rank of `world`, joining the store at host:port, on device <local_rank>."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.dist.follower", "--service", service, "--rank", str(rank),
         "--local-rank", str(local_rank), "--world", str(world), "--host", host, "--port", str(port),
         "--backend", backend, "--timeout-s", str(timeout_s)],
        preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL,
        # c10d logs every idle store poll as a warning; errors still reach the log.
        env={**os.environ, "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="services.dist.follower")
    ap.add_argument("--service", required=True, choices=["actor", "critic"])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--local-rank", type=int, default=None, help="the rank's device on its host (default: --rank)")
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1", help="rank 0's store: its host's address")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {a.service}-rank{a.rank} %(levelname)s %(message)s")
    parent = os.getppid()
    timeout = timedelta(seconds=a.timeout_s)
    try:
        store = dist.TCPStore(a.host, a.port, a.world, is_master=False, timeout=timeout)
        dist.init_process_group(a.backend, store=store, rank=a.rank, world_size=a.world, timeout=timeout)
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        cfg = RunConfig.model_validate(box[0])
        from services.dist.ops import RankTrainer  # after the group: it builds sharded modules

        trainer = RankTrainer(cfg, a.service, a.rank if a.local_rank is None else a.local_rank)
        seq = 0
        while True:
            cmd = receive(store, seq, parent)
            seq += 1
            if cmd.op is Op.STOP:
                return 0
            trainer.run(cmd)
    except RankError as err:
        log.error("follower stops: %s", err)
        return 3
    except Exception as err:  # the service fails as a whole; rank 0 sees this exit
        log.error("follower failed: %s: %s", type(err).__name__, str(err)[:500])
        return 1


if __name__ == "__main__":
    sys.exit(main())

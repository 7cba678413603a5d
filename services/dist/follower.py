"""A follower rank: joins rank 0's process group, receives the run's config, builds the same
sharded trainer and runs every command rank 0 announces until STOP or rank 0's death.

Started by `group.RankGroup` as `python -m services.dist.follower --service S --rank R --world N
--port P`; never by hand. Any failure exits non-zero, which fails the whole service."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from services.core.config import RunConfig, ServiceName
from services.dist.protocol import Op, RankError, receive

log = logging.getLogger("rlfleet.dist.follower")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="services.dist.follower")
    ap.add_argument("--service", required=True, choices=["actor", "critic"])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {a.service}-rank{a.rank} %(levelname)s %(message)s")
    parent = os.getppid()
    timeout = timedelta(seconds=a.timeout_s)
    try:
        store = dist.TCPStore("127.0.0.1", a.port, a.world, is_master=False, timeout=timeout)
        dist.init_process_group(a.backend, store=store, rank=a.rank, world_size=a.world, timeout=timeout)
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        cfg = RunConfig.model_validate(box[0])
        from services.dist.ops import RankTrainer  # after the group: it builds sharded modules

        trainer = RankTrainer(cfg, a.service)
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

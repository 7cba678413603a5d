"""A worker host of a multi-host trainer group (a LeaderWorkerSet worker pod):

    python -m services.dist.node --service actor --leader HOST --store-port 29500 \\
        --node-rank K --nodes N --gpus-per-node G

joins rank 0's store (retrying, within --connect-timeout-s, while the leader is not up yet), checks
its arguments against rank 0's layout, then starts this host's G follower ranks (global ranks
K x G + local rank, on device <local rank>) and lives as long as all of them and rank 0 do.

Exit status: 0 after SIGTERM or SIGINT (its ranks stopped) or when rank 0 stopped the group;
2 for bad arguments or a layout that disagrees with rank 0's; 3 when rank 0 cannot be reached or
went away; 1 when one of its ranks died. Every non-zero exit lets LWS's RecreateGroupOnPodRestart
recreate the whole group, the Kubernetes form of "a dead rank is a dead service"."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any, NoReturn

from services.core.observability.logs import setup_logging
from services.core.retry import Policy

log = logging.getLogger("rlfleet.dist.node")

GRACE_S = 10.0  # how long ranks get to exit after SIGTERM, or after a sibling's clean exit


class NodeError(Exception):
    """Ends the node with `code`; the message is the one line the user sees."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise NodeError(2, f"services.dist.node: {message}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(prog="python -m services.dist.node", description=__doc__.split("\n\n")[0])
    ap.add_argument("--service", required=True, choices=["actor", "critic"])
    ap.add_argument("--leader", required=True, help="rank 0's host (LWS_LEADER_ADDRESS)")
    ap.add_argument("--store-port", type=int, default=29500, help="rank 0's RLFLEET_DIST_STORE_PORT")
    ap.add_argument("--node-rank", type=int, required=True, help="this host's index (LWS_WORKER_INDEX), 1..nodes-1")
    ap.add_argument("--nodes", type=int, required=True, help="hosts in the group, the leader's included")
    ap.add_argument("--gpus-per-node", type=int, required=True, help="trainer ranks on every host")
    ap.add_argument("--connect-timeout-s", type=float, default=600.0, help="how long to wait for rank 0's store")
    ap.add_argument("--log-level", default="INFO")
    a = ap.parse_args(argv)
    if a.nodes < 2:
        ap.error(f"--nodes {a.nodes}: a worker node belongs to a group of 2 or more hosts")
    if not 1 <= a.node_rank < a.nodes:
        ap.error(f"--node-rank {a.node_rank}: must be 1..{a.nodes - 1} (node 0 is the leader, rank 0's host)")
    if not 1 <= a.gpus_per_node <= 64:
        ap.error(f"--gpus-per-node {a.gpus_per_node}: must be 1..64")
    if not 1 <= a.store_port <= 65535:
        ap.error(f"--store-port {a.store_port}: must be 1..65535")
    if not a.leader.strip():
        ap.error("--leader is empty (is LWS_LEADER_ADDRESS set?)")
    if a.connect_timeout_s <= 0:
        ap.error(f"--connect-timeout-s {a.connect_timeout_s:g}: must be > 0")
    return a


def connect(a: argparse.Namespace) -> Any:
    """rank 0's store, once it listens. The leader pod may start later than this one (or its DNS
    name may not resolve yet): a plain TCP probe is retried first, so c10d never logs a failure."""
    import torch.distributed as dist

    def probe() -> None:
        socket.create_connection((a.leader, a.store_port), timeout=5).close()

    async def reachable() -> None:
        await Policy(retry_on=(OSError,), initial_s=0.5, max_s=5.0,
                     deadline_s=a.connect_timeout_s).call(lambda: asyncio.to_thread(probe),
                                                          what=f"reach rank 0's store at {a.leader}:{a.store_port}")

    try:
        asyncio.run(reachable())
        return dist.TCPStore(a.leader, a.store_port, None, is_master=False, timeout=timedelta(seconds=60))
    except (OSError, RuntimeError) as err:
        raise NodeError(3, f"rank 0's store at {a.leader}:{a.store_port} is unreachable after"
                           f" {a.connect_timeout_s:g} s: {str(err).splitlines()[0][:200]}") from None


def join(store: Any, a: argparse.Namespace) -> dict[str, Any]:
    """Check this node against rank 0's layout, take this node's slot, wait for the start."""
    from services.dist.nodes import LAYOUT_KEY, START_KEY, joined_key

    layout = json.loads(store.get(LAYOUT_KEY))
    want = (a.service, a.nodes, a.gpus_per_node)
    have = (layout["service"], layout["nodes"], layout["local"])
    if want != have:
        raise NodeError(2, f"--service {a.service} --nodes {a.nodes} --gpus-per-node {a.gpus_per_node} disagrees"
                           f" with rank 0's group ({have[0]}, {have[1]} nodes x {have[2]} ranks); set both alike")
    me = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
    if store.compare_set(joined_key(a.node_rank), "", me).decode() != me:
        raise NodeError(2, f"node rank {a.node_rank} has already joined this leader: two nodes share one index")
    log.info("joined rank 0's store; waiting for every node", extra={"node": a.node_rank, "leader": a.leader})
    deadline = time.monotonic() + a.connect_timeout_s
    while not store.check([START_KEY]):
        if time.monotonic() > deadline:
            raise NodeError(3, f"rank 0 did not start the group within {a.connect_timeout_s:g} s of this node joining")
        time.sleep(0.2)
    return dict(layout)


def supervise(store: Any, a: argparse.Namespace, layout: dict[str, Any], stop: threading.Event) -> int:
    """Start this host's ranks, beat, and end when any of them, rank 0 or a signal ends."""
    from services.dist.follower import spawn
    from services.dist.nodes import BEAT_EVERY_S, beat_key, exit_key, pids_key

    first = a.node_rank * a.gpus_per_node
    procs = [spawn(a.service, first + i, i, int(layout["world"]), a.leader, a.store_port, str(layout["backend"]),
                   float(layout["timeout_s"])) for i in range(a.gpus_per_node)]
    store.set(pids_key(a.node_rank), json.dumps([p.pid for p in procs]))
    log.info("ranks started", extra={"node": a.node_rank, "ranks": [first, first + a.gpus_per_node - 1],
                                     "world": layout["world"]})

    def end(code: int, why: str) -> int:
        if why:
            try:
                store.set(exit_key(a.node_rank), why)  # rank 0 learns at once, not after the heartbeat timeout
            except Exception:  # noqa: BLE001 - rank 0 is gone: nobody to tell
                pass
        _stop_all(procs, GRACE_S if code == 0 else 0.0)
        return code

    while True:
        if stop.is_set():
            log.info("stopping on a signal", extra={"node": a.node_rank})
            return end(0, f"node {a.node_rank} stopped by a signal")
        codes = [p.poll() for p in procs]
        if any(c is not None for c in codes):
            if all(c == 0 for c in codes if c is not None):
                # A STOP from rank 0 ends every rank cleanly; give the siblings time to follow.
                _wait_all(procs, GRACE_S)
                if all(p.returncode == 0 for p in procs):
                    log.info("rank 0 stopped the group", extra={"node": a.node_rank})
                    return 0
            failed = {first + i: p.returncode for i, p in enumerate(procs) if p.returncode not in (None, 0)}
            log.error("a rank died; the node stops", extra={"node": a.node_rank, "exit_codes": failed})
            return end(1, f"rank(s) {sorted(failed)} on node {a.node_rank} exited ({failed})")
        t0 = time.monotonic()
        try:
            store.add(beat_key(a.node_rank), 1)
            took = time.monotonic() - t0
            if took > BEAT_EVERY_S:  # rank 0 counts the node dead after node_timeout_s without one
                log.warning("heartbeat slow", extra={"node": a.node_rank, "seconds": round(took, 2)})
        except Exception as err:  # noqa: BLE001 - rank 0's store answered nothing: rank 0 is gone
            # Gone after a STOP, or died? Rank 0 stops the group by a STOP to every rank, then exits, and
            # its store with it: a beat can fail before this host's ranks, told to stop, have exited.
            # Their exit codes tell the two apart (a rank whose rank 0 died never exits 0).
            _wait_all(procs, GRACE_S)
            if all(p.returncode == 0 for p in procs):
                log.info("rank 0 stopped the group", extra={"node": a.node_rank})
                return 0
            log.error("rank 0 went away; the node stops", extra={"node": a.node_rank, "error": str(err)[:200]})
            return end(3, "")
        stop.wait(BEAT_EVERY_S)


def _wait_all(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            pass


def _stop_all(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    _wait_all(procs, grace_s)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None, process: bool = True) -> int:
    """The node's life; `process=False` (tests calling it in-process) leaves logging and signal
    handlers to the caller."""
    stop = threading.Event()
    try:
        a = parse(argv)
        if process:
            setup_logging(f"{a.service}-node{a.node_rank}", a.log_level)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch loads: c10d warns on idle polls
        store = connect(a)
        layout = join(store, a)
        if stop.is_set():
            return 0
        return supervise(store, a, layout, stop)
    except NodeError as err:
        print(str(err), file=sys.stderr)
        return err.code
    except (RuntimeError, OSError) as err:  # a store call failed: rank 0 went away meanwhile
        print(f"rank 0's store failed: {str(err).splitlines()[0][:200] if str(err) else type(err).__name__}",
              file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())

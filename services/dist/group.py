"""Rank 0's side: start the follower ranks, form the process group, and run each command on every
rank at once. The service process is rank 0 and keeps speaking gRPC, HTTP and Redis.

Followers die with rank 0 (PR_SET_PDEATHSIG, and their store wait sees rank 0 go), so a killed
service leaves no orphans. Over several hosts (RLFLEET_DIST_NODES > 1, `nodes`) rank 0 starts only
its own host's followers and waits for the other hosts' `services.dist.node` to join its store.
A follower or node that dies, or a collective that fails or outlasts the timeout, marks the
group broken: `alive` turns false and the service stops so its supervisor restarts it, ranks
and all (a dead rank is a dead service)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, Gauge
from safetensors import safe_open

from services.core.config.run import RunConfig, ServiceName
from services.dist.follower import spawn
from services.dist.nodes import START_KEY, Layout, NodeWatch, layout_for, master_store, publish_layout
from services.dist.ops import RankTrainer, check_names
from services.dist.protocol import Command, Op, RankError, announce
from services.models.checkpoints.checkpoint import CheckpointMeta
from services.models.checkpoints.layout import DCP_DIR, MODEL_FILE
from services.models.engine import WeightSyncError

log = logging.getLogger("rlfleet.dist")

@dataclass
class RankInfo:
    rank: int
    pid: int  # on its own host
    node: int = 0
    alive: bool = True
    step_seconds: float = 0.0
    memory_bytes: int = 0


class RankGauges:
    """rlfleet_trainer_rank_{alive,step_seconds,memory_bytes}{rank} in the service's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.alive = Gauge("rlfleet_trainer_rank_alive", "1 while the trainer rank's process lives", ["rank"],
                           registry=registry)
        self.step_seconds = Gauge("rlfleet_trainer_rank_step_seconds", "The rank's last train step, seconds",
                                  ["rank"], registry=registry)
        self.memory = Gauge("rlfleet_trainer_rank_memory_bytes",
                            "The rank's peak memory (CUDA allocated, else process RSS)", ["rank"], registry=registry)

    def show(self, ranks: list[RankInfo]) -> None:
        for r in ranks:
            label = str(r.rank)
            self.alive.labels(rank=label).set(int(r.alive))
            self.step_seconds.labels(rank=label).set(r.step_seconds)
            self.memory.labels(rank=label).set(r.memory_bytes)


class RankGroup:
    def __init__(self, cfg: RunConfig, service: ServiceName, layout: Layout | None = None) -> None:
        ep = cfg.endpoint(service)
        self.layout = layout or layout_for(cfg, service)
        self.service, self.world = service, self.layout.world
        self.timeout = timedelta(seconds=cfg.flow.rpc_timeout_s)
        backend = "nccl" if ep.device.startswith("cuda") and torch.cuda.is_available() else "gloo"
        # One host: a loopback store on a free port. Several: the fixed port, on every interface.
        multi = self.layout.multi_node
        self.store = master_store("" if multi else "127.0.0.1", self.layout.store_port, self.timeout)
        self.nodes = NodeWatch(self.store, self.layout) if multi else None
        self.broken: str | None = None
        self.seq = 0
        self.lock = threading.Lock()  # one command at a time, whichever thread sends it
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ranks = [RankInfo(0, os.getpid())]
        log.info("trainer ranks starting", extra={"service": service, "world": self.world, "backend": backend,
                                                  "nodes": self.layout.nodes})
        if self.nodes is not None:
            publish_layout(self.store, self.layout, service, backend, cfg.flow.rpc_timeout_s)
            self.nodes.wait_joined(service)
            self.store.set(START_KEY, "1")
        self.procs = [spawn(service, r, r, self.world, "127.0.0.1", self.store.port, backend, cfg.flow.rpc_timeout_s)
                      for r in range(1, self.layout.local)]
        self.ranks += [RankInfo(r, p.pid) for r, p in enumerate(self.procs, 1)]
        self._join(backend)
        if self.nodes is not None:
            for k, pids in self.nodes.pids().items():
                self.ranks += [RankInfo(r, pid, node=k) for r, pid in zip(self.layout.ranks_of(k), pids, strict=True)]
        dist.broadcast_object_list([cfg.model_dump(mode="json")], src=0)
        self.trainer = RankTrainer(cfg, service)

    def _join(self, backend: str) -> None:
        """init_process_group, but a follower that dies while starting fails it at once rather
        than after the whole timeout."""
        err: list[BaseException] = []

        def init() -> None:
            try:
                dist.init_process_group(backend, store=self.store, rank=0, world_size=self.world,
                                        timeout=self.timeout)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                err.append(e)

        t = threading.Thread(target=init, name="rank-join", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            dead = self.dead()
            if dead:
                self.stop()
                raise RankError(f"{self.service} trainer rank(s) {dead} exited while joining the group")
        if err:
            self.stop()
            raise RankError(f"{self.service} trainer ranks could not form a group: {err[0]}")

    # -- commands --------------------------------------------------------------------------------
    def call(self, op: Op, *args: Any) -> Any:
        """Run `op` on every rank; rank 0's result. Any failure breaks the group for good."""
        with self.lock:
            if self.broken is not None:
                raise RankError(self.broken)
            cmd = Command(op, args)
            try:
                announce(self.store, self.seq, cmd)
                self.seq += 1
                return self.trainer.run(cmd)
            except Exception as err:
                self.broken = f"{self.service} trainer ranks failed in {op.value}: {type(err).__name__}: {err}"[:500]
                log.error("trainer ranks broken", extra={"service": self.service, "error": self.broken})
                raise RankError(self.broken) from err

    def train(self, *args: Any) -> dict[str, float]:
        stats, per_rank = self.call(Op.TRAIN, *args)
        for info, (seconds, mem) in zip(self.ranks, per_rank, strict=True):
            info.step_seconds, info.memory_bytes = float(seconds), int(mem)
        return dict(stats)

    def full_state(self) -> dict[str, Any]:
        """The whole model's state dict on rank 0's CPU, gathered from every rank's shards."""
        return dict(self.call(Op.FULL_STATE))

    # -- checkpoints and weights (services.workers.trainable.Ranks) ---------------------------------
    def write(self, tmp: Path) -> None:
        self.call(Op.SAVE, str(tmp / DCP_DIR))

    def load(self, meta: CheckpointMeta, opt_state: dict[str, Any] | None) -> None:
        if meta.layout == "dcp":
            self.call(Op.LOAD, str(meta.path / DCP_DIR), "dcp", None)
        else:
            self._check(meta.path / MODEL_FILE)
            self.call(Op.LOAD, str(meta.path / MODEL_FILE), meta.layout, opt_state)

    def load_weights(self, files: list[Path], opt_state: dict[str, Any] | None) -> None:
        self._check(*files)
        self.call(Op.LOAD_WEIGHTS, [str(f) for f in files], opt_state)

    def _check(self, *files: Path) -> None:
        # On rank 0 first: weights that do not fit are refused, not a broken group.
        names: dict[str, Any] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                names.update(dict.fromkeys(sf.keys()))
        try:
            check_names(self.trainer.model, names)
        except ValueError as err:
            raise WeightSyncError(str(err)) from None

    # -- health ----------------------------------------------------------------------------------
    def dead(self) -> list[int]:
        """Dead ranks: local followers that exited, and every rank of a worker node that died."""
        out = []
        for info, p in zip(self.ranks[1:], self.procs, strict=False):
            if p.poll() is not None:
                info.alive = False
                out.append(info.rank)
        if self.nodes is not None:
            # By the layout, not self.ranks: a node that dies while the group forms has no rows yet.
            gone = set(self.nodes.dead())
            for info in self.ranks:
                info.alive = info.alive and info.node not in gone
            out += [r for k in sorted(gone) for r in self.layout.ranks_of(k)]
        return out

    @property
    def alive(self) -> bool:
        return self.broken is None and not self.dead()

    def why_dead(self) -> str:
        dead = self.dead()
        if dead:
            local = [f"rank {r} exit {self.procs[r - 1].returncode}" for r in dead if r < self.layout.local]
            nodes = [f"node {k}: {why}" for k, why in sorted(self.nodes.why.items())] if self.nodes else []
            return (f"{self.service} trainer rank(s) died ({', '.join(local + nodes)}); the service stops so that it"
                    " is restarted")
        return self.broken or "trainer ranks alive"

    def status(self) -> list[dict[str, Any]]:
        self.dead()
        return [{"rank": r.rank, "pid": r.pid, "alive": r.alive, "step_seconds": round(r.step_seconds, 3),
                 "memory_bytes": r.memory_bytes, **({"node": r.node} if self.nodes is not None else {})}
                for r in self.ranks]

    def stop(self, grace_s: float = 10.0) -> None:
        """STOP the followers when the group works, then make sure every one is gone."""
        if self.broken is None and not self.dead() and dist.is_initialized():
            with contextlib.suppress(Exception):
                self.call(Op.STOP)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(deadline - time.monotonic(), 0.1))
            if p.poll() is None:
                p.kill()
                p.wait()
        self.broken = self.broken or "stopped"

    def close(self) -> None:
        """Stop the followers and leave the process group (a test, or a service that goes on)."""
        self.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


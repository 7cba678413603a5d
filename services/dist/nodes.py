"""Trainer ranks beyond one host: the group's layout that rank 0 reads from its environment (the
LeaderWorkerSet overlay sets it on the leader pod), the store it binds, the keys by which the
worker nodes (`python -m services.dist.node`) join it, and rank 0's watch over those nodes.

Join protocol, all on rank 0's TCPStore: rank 0 publishes `group/layout`; each node connects,
checks its arguments against it and sets `node/<k>/joined`; once every node has joined rank 0 sets
`group/start` and all ranks form the process group within seconds of each other (so no rank's
rendezvous waits on a late host). Afterwards every node adds to `node/<k>/beat` once a second and
sets `node/<k>/exit` before it exits; rank 0 counts a node dead when that key appears or its beat
stands still for `node_timeout_s` (a node killed by SIGKILL writes nothing)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.core.config.run import ConfigError, RunConfig, ServiceName
from services.core.host.ports import c10d_store

log = logging.getLogger("rlfleet.dist")

ENV_PREFIX = "RLFLEET_DIST_"
LAYOUT_KEY = "group/layout"
START_KEY = "group/start"
BEAT_EVERY_S = 1.0


def joined_key(node: int) -> str:
    return f"node/{node}/joined"


def beat_key(node: int) -> str:
    return f"node/{node}/beat"


def pids_key(node: int) -> str:
    return f"node/{node}/pids"


def exit_key(node: int) -> str:
    return f"node/{node}/exit"


class DistConfigError(ConfigError):
    """A multi-host setting that cannot work; its message is one line naming the variable."""


class DistEnv(BaseModel):
    """RLFLEET_DIST_<FIELD> of the leader's environment; unset, the group is one host."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int = Field(1, ge=1, le=64)
    """Hosts in the group (LWS_GROUP_SIZE); 1 is the single-host group of `trainer_ranks`."""
    gpus_per_node: int = Field(1, ge=1, le=64)
    """Trainer ranks (one per GPU) on every host, the leader's included."""
    store_port: int = Field(29500, ge=1, le=65535)
    """The port rank 0's TCPStore listens on, on all interfaces, for the worker nodes."""
    join_timeout_s: float = Field(600.0, gt=0)
    """How long rank 0 waits for every worker node to join before it fails (and is restarted)."""
    node_timeout_s: float = Field(15.0, gt=0)
    """A worker node whose heartbeat stands still this long is dead, and so is the service."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        raw = {name: env[ENV_PREFIX + name.upper()] for name in cls.model_fields if ENV_PREFIX + name.upper() in env}
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            e = err.errors()[0]
            var = ENV_PREFIX + str(e["loc"][0]).upper()
            raise DistConfigError(f"{var}={e.get('input')!r}: {e['msg'].lower()}") from None


@dataclass(frozen=True)
class Layout:
    """Who runs where: `nodes` hosts of `local` ranks each; global rank = node x local + local rank."""

    world: int
    nodes: int
    local: int
    store_port: int = 0
    join_timeout_s: float = 600.0
    node_timeout_s: float = 15.0

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    def ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.local, (node + 1) * self.local))


def layout_for(cfg: RunConfig, service: ServiceName, environ: Mapping[str, str] | None = None) -> Layout:
    """The service's group: `trainer_ranks` on one host, or RLFLEET_DIST_NODES x GPUS_PER_NODE
    ranks over several. The environment defines the world (the overlay's config leaves
    trainer_ranks at 1); a trainer_ranks set otherwise must agree with it."""
    env = DistEnv.from_environ(environ)
    ranks = cfg.endpoint(service).trainer_ranks
    if env.nodes == 1:
        return Layout(world=ranks, nodes=1, local=ranks)
    world = env.nodes * env.gpus_per_node
    if ranks not in (1, world):
        raise DistConfigError(
            f"RLFLEET_DIST_NODES x RLFLEET_DIST_GPUS_PER_NODE = {env.nodes} x {env.gpus_per_node} = {world} ranks,"
            f" but services.{service}.trainer_ranks is {ranks}: set it to {world} or leave it at 1")
    if service == "actor" and cfg.models.policy.lora is not None:
        raise DistConfigError("RLFLEET_DIST_NODES > 1 with models.policy.lora: LoRA adapters train on one rank")
    return Layout(world=world, nodes=env.nodes, local=env.gpus_per_node, store_port=env.store_port,
                  join_timeout_s=env.join_timeout_s, node_timeout_s=env.node_timeout_s)


def world_size(cfg: RunConfig, service: ServiceName) -> int:
    return layout_for(cfg, service).world


def master_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's store, listening on `host` only (loopback for one host, all interfaces for several)."""
    try:
        return c10d_store(host, port, timeout)
    except OSError as err:
        raise DistConfigError(f"rank 0's store cannot listen on {host or '*'}:{port}: {err.strerror}"
                              + (" (RLFLEET_DIST_STORE_PORT)" if port else "")) from None


def publish_layout(store: dist.Store, layout: Layout, service: str, backend: str, timeout_s: float) -> None:
    store.set(LAYOUT_KEY, json.dumps({"service": service, "world": layout.world, "nodes": layout.nodes,
                                      "local": layout.local, "backend": backend, "timeout_s": timeout_s}))


@dataclass
class NodeWatch:
    """Rank 0's view of the worker nodes: which have joined, and which have died since."""

    store: dist.Store
    layout: Layout
    beats: dict[int, tuple[int, float]] = field(default_factory=dict)  # node -> (beat, when it last moved)
    why: dict[int, str] = field(default_factory=dict)

    @property
    def remote(self) -> list[int]:
        return list(range(1, self.layout.nodes))

    def missing(self) -> list[int]:
        return [k for k in self.remote if not self.store.check([joined_key(k)])]

    def wait_joined(self, service: str) -> None:
        """Block until every worker node has joined (bounded by join_timeout_s)."""
        deadline = time.monotonic() + self.layout.join_timeout_s
        while True:
            missing = self.missing()
            if not missing:
                break
            if time.monotonic() > deadline:
                raise DistConfigError(
                    f"{service}: node rank(s) {missing} did not join rank 0's store on port {self.layout.store_port}"
                    f" within {self.layout.join_timeout_s:g} s (RLFLEET_DIST_JOIN_TIMEOUT_S); is"
                    f" `python -m services.dist.node` running on every host?")
            time.sleep(0.2)
        now = time.monotonic()
        self.beats = {k: (-1, now) for k in self.remote}
        log.info("worker nodes joined", extra={"service": service, "nodes": {
            k: json.loads(self.store.get(joined_key(k))).get("host") for k in self.remote}})

    def pids(self) -> dict[int, list[int]]:
        """Each node's follower pids (set as it starts them, so present once the group formed)."""
        return {k: [int(p) for p in json.loads(self.store.get(pids_key(k)))] for k in self.remote}

    def dead(self) -> list[int]:
        """Worker nodes that exited (their own word) or whose heartbeat stopped."""
        for k in self.remote:
            if k in self.why:
                continue
            try:
                if self.store.check([exit_key(k)]):
                    self.why[k] = self.store.get(exit_key(k)).decode(errors="replace")[:300]
                    continue
                beat = int(self.store.add(beat_key(k), 0))
            except Exception as err:  # rank 0's own store failing: nothing can be trusted
                self.why[k] = f"store unreadable: {err}"[:300]
                continue
            # The clock is read after the store: a read that waited behind another thread's store call
            # (the group's rendezvous) must not date the beat it returns back to before the wait.
            now = time.monotonic()
            last, since = self.beats.get(k, (-1, now))
            if beat != last:
                self.beats[k] = (beat, now)
            elif now - since > self.layout.node_timeout_s:
                self.why[k] = f"no heartbeat for {now - since:.0f} s (RLFLEET_DIST_NODE_TIMEOUT_S)"
        return sorted(self.why)

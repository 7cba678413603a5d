"""The controller's side of the trainable services (actor, critic): `Train` with retry, replay of
the journaled steps a restarted service missed, and the watch that records the versions they serve.

`Train` is keyed by the version it produces, so it is safe to repeat: it is retried while the
service is away (restarting, being swapped), and a service that restarted behind the journal
answers FAILED_PRECONDITION and is replayed first, oldest step first, never past the journal's
committed step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from services.core.config.run import RunConfig
from services.core.journal.journal import Journal
from services.core.observability.events import EventLog
from services.core.pb import rlfleet_pb2 as pb
from services.core.pb import rlfleet_pb2_grpc as pb_grpc
from services.core.retry import Policy, grpc_codes
from services.core.serving.runtime import make_channel, rpc
from services.rl.wire import message, parse_message

log = logging.getLogger("rlfleet.controller")

AWAY = grpc_codes(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _behind(e: grpc.aio.AioRpcError) -> bool:
    return e.code() == grpc.StatusCode.FAILED_PRECONDITION


class Trainables:
    def __init__(self, cfg: RunConfig, names: list[str], journal: Journal, events: EventLog,
                 committed: Callable[[], int]) -> None:
        self.cfg, self.names, self.journal, self.events = cfg, names, journal, events
        self.committed = committed  # the journal's committed version: replay never goes past it
        # A service away for up to rpc_timeout_s (a restart, a swap) is waited for, not failed.
        self.train_retry = Policy(retry_on=AWAY, initial_s=0.2, max_s=2.0, deadline_s=cfg.flow.rpc_timeout_s)
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.replay_locks = {name: asyncio.Lock() for name in names}
        self.served: dict[str, int] = {}  # last version each service was recorded serving

    def stub(self, name: str) -> Any:
        if name not in self.channels:
            ep = self.cfg.endpoint(name)  # type: ignore[arg-type]
            self.channels[name] = make_channel(ep.host, ep.grpc_port, self.cfg.flow.max_message_bytes)
        ch = self.channels[name]
        return pb_grpc.ActorStub(ch) if name == "actor" else pb_grpc.CriticStub(ch)

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()
        self.channels.clear()

    async def state(self, name: str) -> pb.ServiceState:
        return await rpc(self.stub(name).GetState, message(pb.GetStateRequest), timeout_s=5.0,
                         idempotent=True, retries=1, token=self.cfg.token())

    async def _send(self, name: str, batch: pb.TrainBatch) -> pb.TrainResult:
        t = self.cfg.flow.rpc_timeout_s
        return await self.train_retry.call(
            lambda: rpc(self.stub(name).Train, batch, timeout_s=t, idempotent=True, retries=0, token=self.cfg.token()),
            what=f"Train on {name}")

    async def train(self, name: str, batch: pb.TrainBatch) -> pb.TrainResult:
        """One step's Train on one service, replaying what it missed first when it is behind."""
        async with self.replay_locks[name]:
            pass  # never interleave a new step with a replay in progress
        while True:
            try:
                return await self._send(name, batch)
            except grpc.aio.AioRpcError as e:
                if not _behind(e):
                    raise
                await self.replay(name)

    async def replay(self, name: str) -> int:
        """Bring a service that restarted from an older checkpoint up to the journal's committed
        version by re-sending the training batches after its version, oldest first. Returns the
        steps replayed."""
        async with self.replay_locks[name]:
            n = 0
            while True:
                have = int((await self.state(name)).version)
                todo = [(s, raw) for s, raw in await asyncio.to_thread(self.journal.batches_after, have)
                        if s <= self.committed()]
                try:
                    for _, raw in todo:
                        await self._send(name, parse_message(pb.TrainBatch, raw,
                                                             max_bytes=self.cfg.flow.max_message_bytes))
                        n += 1
                    break
                except grpc.aio.AioRpcError as e:
                    if not _behind(e):
                        raise
                    # It restarted again mid-replay, from an older checkpoint: start over from there.
                    log.warning("service restarted during replay; replaying again", extra={"service": name})
            if n:
                log.info("replayed training batches", extra={"service": name, "from_version": have, "steps": n})
            return n

    async def watch_once(self) -> None:
        """One look at each service: record the version it serves and the checkpoint it
        acknowledges (pruning replay batches no one needs), and replay one that fell behind."""
        acked = await asyncio.to_thread(lambda: self.journal.versions)
        for name in self.names:
            try:
                state = await self.state(name)
            except grpc.aio.AioRpcError:
                continue  # away (restarting); Train retries cover it
            v = int(state.version)
            # A replacement still catching up is not ready, so not serving. A version the journal
            # has not acknowledged yet (its step is still committing) is recorded once it is.
            if state.state == "ready" and self.served.get(name) != v and v <= acked.get(name, 0):
                self.served[name] = v
                self.events.emit("version_served", service=name, version=v)
            ckpt = int(state.gauges.get("checkpoint_version", 0))
            if ckpt > self.journal.checkpoint_steps.get(name, 0):
                await asyncio.to_thread(self.journal.prune_batches, name, ckpt)
                self.events.emit("checkpoint", service=name, version=ckpt, step=ckpt)
            if v < self.committed() and not self.replay_locks[name].locked():
                await self.replay(name)

"""Replay (services/controller/trainables.py) against a real LMDB journal and a real gRPC trainable:
an in-process Actor service whose Train goes through the real `Trainable` version gate (it applies
a step by moving its version; the model is not what is under test). A service restarted behind the
journal is replayed oldest step first, never past the committed version, before a new step; the
controller records a served version only once it is ready at a version the journal acknowledged."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from services.controller.trainables import Trainables
from services.core.journal.journal import Journal
from services.core.observability.events import EventLog, iter_events
from services.core.pb import rlfleet_pb2 as pb
from services.core.pb import rlfleet_pb2_grpc as pb_grpc
from services.rl.wire import message
from services.workers.trainable import Trainable
from tests.fleet_helpers import commit_steps, tiny_config


class _GatedActor(pb_grpc.ActorServicer):
    def __init__(self, t: Trainable, state: str = "ready") -> None:
        self.t, self.state, self.applied = t, state, []

    async def Train(self, request: pb.TrainBatch, context: Any) -> pb.TrainResult:  # noqa: N802
        async with self.t.lock:
            done = await self.t.gate(int(request.step), int(request.target_version), context)
            if done is not None:
                return done
            self.t.version = int(request.target_version)
            self.applied.append(self.t.version)
            return message(pb.TrainResult, step=request.step, version=self.t.version)

    async def GetState(self, request: pb.GetStateRequest, context: Any) -> pb.ServiceState:  # noqa: N802
        return message(pb.ServiceState, service="actor", state=self.state, version=self.t.version,
                       gauges={"checkpoint_version": float(self.t.checkpoint_version)})


def _batch(step: int) -> bytes:
    """The journaled TrainBatch of 1-based step `step` (it produces version `step`)."""
    return message(pb.TrainBatch, step=step - 1, batch_id=f"s{step - 1}", target_version=step).SerializeToString()


@pytest.fixture
def world(tmp_path: Path, tiny_model: Path) -> Iterator[Any]:
    """(run(coro_fn), journal, servicer, events path): one event loop hosts server and controller side."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # the gRPC server binds to the loop current when it is made
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    cfg = tiny_config(tmp_path / "run", tiny_model, services={"actor": {"grpc_port": port, "http_port": 0}},
                      flow={"rpc_timeout_s": 10.0})
    cfg.run_dir.mkdir(parents=True)
    model = torch.nn.Linear(2, 2)
    t = Trainable(cfg, "actor", model, torch.optim.SGD(model.parameters(), lr=0.1))
    servicer = _GatedActor(t)
    pb_grpc.add_ActorServicer_to_server(servicer, server)
    loop.run_until_complete(server.start())
    journal = Journal.open(cfg.journal_dir, stages=("reward",), trainable=("actor",))
    for step in range(1, 5):
        journal.put_batch(step, _batch(step))
    commit_steps(journal, 4)
    events = EventLog(cfg.run_dir / "events.jsonl")
    side = Trainables(cfg, ["actor"], journal, events, committed=lambda: journal.step)
    try:
        yield loop.run_until_complete, side, journal, servicer, cfg.run_dir / "events.jsonl"
    finally:
        loop.run_until_complete(side.close())
        loop.run_until_complete(server.stop(0))
        loop.close()
        asyncio.set_event_loop(None)
        events.close()
        journal.close()


def test_a_restarted_service_is_replayed_oldest_step_first_up_to_the_journal(world: Any) -> None:
    run, side, _, svc, _ = world
    svc.t.version = 1  # restarted from its version-1 checkpoint
    assert run(side.replay("actor")) == 3
    assert svc.applied == [2, 3, 4]
    assert run(side.replay("actor")) == 0, "a service at the journal's version needs no replay"


def test_replay_never_passes_the_committed_version(world: Any) -> None:
    run, side, _, svc, _ = world
    svc.t.version = 1
    side.committed = lambda: 3  # step 4 is journaled but still committing
    assert run(side.replay("actor")) == 2
    assert svc.applied == [2, 3]


def test_a_new_step_on_a_service_behind_replays_what_it_missed_first(world: Any) -> None:
    run, side, journal, svc, _ = world
    svc.t.version = 2
    journal.put_batch(5, _batch(5))
    res = run(side.train("actor", pb.TrainBatch.FromString(_batch(5))))
    assert res.version == 5 and svc.applied == [3, 4, 5]
    again = run(side.train("actor", pb.TrainBatch.FromString(_batch(5))))
    assert again.replayed and svc.applied == [3, 4, 5], "Train is idempotent: a repeat applies nothing"


def test_served_versions_are_recorded_only_when_ready_and_acknowledged(world: Any) -> None:
    run, side, journal, svc, events_path = world
    svc.t.version = 4
    journal.set_version("actor", 3)  # step 4 trained but its commit is not written yet
    run(side.watch_once())
    svc.state = "unready"
    journal.set_version("actor", 4)
    run(side.watch_once())  # catching up (not ready): not serving
    svc.state = "ready"
    run(side.watch_once())
    run(side.watch_once())  # no change: no second event
    side.events.close()
    served = [e.fields["version"] for e in iter_events(events_path) if e.kind == "version_served"]
    assert served == [4]

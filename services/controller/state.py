"""What the controller's helpers may touch of it, as protocols: `StepState` (the join, the journal
and the step's bookkeeping, for dynamic sampling and unscored rows) and `RecoveryHost` (that plus
the publishing and pausing recovery needs). The controller satisfies both structurally; the
helpers name only these, so none of them depends on the controller's server module."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from services.controller.admission import Admission, BadPrompts
    from services.controller.assembler import StepAssembler
    from services.controller.components import ComponentMeans
    from services.controller.durable import DurableJournal
    from services.controller.sampling import FleetSampling
    from services.core.config.run import RunConfig
    from services.core.journal.journal import Journal
    from services.core.observability.events import EventLog
    from services.core.observability.metrics import ServiceMetrics
    from services.core.pb import rlfleet_pb2 as pb
    from services.core.transport.bus import Bus


class StepState(Protocol):
    """The join of rollouts and scores, the journal, and each batch's bookkeeping until its step."""

    @property
    def cfg(self) -> RunConfig: ...
    @property
    def assembler(self) -> StepAssembler: ...
    @property
    def journal(self) -> Journal: ...
    @property
    def durable(self) -> DurableJournal: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def metrics(self) -> ServiceMetrics: ...
    @property
    def progress(self) -> dict[str, float]: ...
    @property
    def reward_parts(self) -> ComponentMeans: ...


class RecoveryHost(StepState, Protocol):
    """What re-sending lost messages and rebuilding the join after a restart use besides."""

    @property
    def admission(self) -> Admission: ...
    @property
    def sampling(self) -> FleetSampling | None: ...
    @property
    def bus(self) -> Bus | None: ...
    @property
    def stages(self) -> Sequence[str]: ...
    @property
    def state_lock(self) -> asyncio.Lock: ...
    @property
    def running(self) -> bool: ...

    async def bad_prompts(self, bad: BadPrompts) -> None: ...
    async def pause(self, seconds: float) -> None: ...
    async def publish_prompts(self, batch: pb.PromptBatch) -> None: ...
    async def publish_rollout(self, rid: str, data: bytes) -> None: ...
    async def sync_states(self, pbid: str) -> None: ...

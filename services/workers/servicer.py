"""The gRPC calls every worker service (actor, critic, reward, reference) answers the same way:
GetState and Drain. A servicer inherits them before its generated base class, e.g.
`class _ActorServicer(ServiceCalls, pb_grpc.ActorServicer)`, and adds only its own calls."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from services.core.pb import rlfleet_pb2 as pb
from services.core.serving.runtime import ServiceRuntime
from services.rl.wire import WireError, check_schema_version, message

if TYPE_CHECKING:  # a type only: trainable pulls in the checkpoint code (torch DCP, peft), ~3 s of imports
    from services.workers.trainable import Trainable


async def invalid(context: Any, err: WireError) -> NoReturn:
    """Answer a request whose content is wrong with INVALID_ARGUMENT and the named reason."""
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{err.reason}: {err}")
    raise AssertionError("unreachable: abort raises")


class ServiceCalls:
    def __init__(self, runtime: ServiceRuntime, service: str, instance: str, version: Callable[[], int],
                 trainable: Trainable | None = None) -> None:
        self.runtime = runtime
        self.service = service
        self.instance = instance
        self.version = version
        self.trainable = trainable

    async def GetState(self, request: pb.GetStateRequest, context: Any) -> pb.ServiceState:  # noqa: N802
        try:
            check_schema_version(request)
        except WireError as e:
            await invalid(context, e)
        t = self.trainable
        gauges = {"checkpoint_version": float(t.checkpoint_version)} if t is not None else {}
        return message(pb.ServiceState, service=self.service, instance_id=self.instance, state=self.runtime.state,
                       version=self.version(), gauges=gauges)

    async def Drain(self, request: pb.DrainRequest, context: Any) -> pb.DrainResponse:  # noqa: N802
        try:
            check_schema_version(request)
            if not (math.isfinite(request.deadline_s) and request.deadline_s >= 0):
                raise WireError("bad_deadline", f"DrainRequest: deadline_s {request.deadline_s} is not a"
                                " finite number of seconds >= 0")
        except WireError as e:
            await invalid(context, e)
        self.runtime.request_drain("rpc")
        return message(pb.DrainResponse, accepted=True, state="draining")

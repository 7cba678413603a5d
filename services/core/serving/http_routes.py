"""The HTTP surface every service serves: /healthz (alive), /readyz (ready or the reasons why not),
/metrics (Prometheus), /v1/status (`ServiceRuntime.describe`) and POST /v1/drain (admin only)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Depends
from fastapi.responses import JSONResponse, Response

from services.core.observability.metrics import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from services.core.serving.runtime import ServiceRuntime


def install_routes(rt: ServiceRuntime) -> None:
    app = rt.app

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        # Alive means the loop answers; a draining service is still alive.
        return {"alive": True, "state": rt.state}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        reasons = await rt.refresh_readiness()
        if reasons:
            return JSONResponse({"ready": False, "state": rt.state, "reasons": reasons}, 503)
        return JSONResponse({"ready": True, "state": rt.state})

    @app.get("/metrics")
    async def metrics() -> Response:
        if rt.gpu is not None and rt.gpu.available:
            await asyncio.to_thread(rt.gpu.update)
        return Response(rt.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        return await rt.describe()

    @app.post("/v1/drain", status_code=202, dependencies=[Depends(rt.require_admin)])
    async def drain() -> dict[str, Any]:
        # Answer first, drain after: the drain ends with this HTTP server stopping.
        rt.request_drain("POST /v1/drain")
        return {"accepted": True, "state": "draining"}

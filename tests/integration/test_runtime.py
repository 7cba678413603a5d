"""The service runtime: a real process with gRPC + HTTP on loopback, its readiness, auth, size
limits and the three ways it ends (drain by HTTP, drain by SIGTERM, main loop crash); plus the
auth interceptor, admin guard, body limit and rpc helper in-process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from services.core.config.run import Endpoint
from services.core.observability.metrics import METRIC_NAMES
from services.core.serving.runtime import ServiceRuntime, make_channel, rpc
from services.core.transport.auth import BodySizeLimitMiddleware, TokenAuthInterceptor, admin_guard

REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-token-0123456789"
MAX_MSG = 64 * 1024
MAX_BODY = 4096

pytestmark = pytest.mark.timeout(30)

SERVICE_SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys
    from pathlib import Path

    import grpc

    from services.core.config.run import Endpoint
    from services.core.observability.logs import setup_logging
    from services.core.serving.runtime import ServiceRuntime

    work, mode, max_msg, max_body = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    setup_logging("testsvc", "INFO")
    stop = asyncio.Event()

    async def readiness():
        # "Model loaded" is the test touching a file.
        return [] if (work / "ready").exists() else ["model not loaded"]

    async def status():
        return {"step": 1}

    async def on_drain():
        stop.set()
        await asyncio.sleep(0.05)  # "finish in-flight work, checkpoint"
        (work / "drained").write_text("ok")

    async def echo(request: bytes, context) -> bytes:
        return request

    def register(server):
        handler = grpc.method_handlers_generic_handler(
            "test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
        )
        server.add_generic_rpc_handlers((handler,))

    async def main():
        if mode == "crash":
            await asyncio.sleep(0.3)
            raise RuntimeError("main loop blew up")
        rt.metrics.tokens.labels(phase="generate").inc(5)
        await stop.wait()

    rt = ServiceRuntime(
        "testsvc",
        endpoint=Endpoint(host="127.0.0.1", grpc_port=0, http_port=0),
        run_dir=work / "run",
        max_message_bytes=max_msg,
        token=os.environ.get("TEST_TOKEN"),
        readiness=readiness,
        status=status,
        on_drain=on_drain,
        max_http_body_bytes=max_body,
        grace_s=1.0,
        readiness_interval_s=0.1,
        gpu=False,
    )
    rt.add_grpc_service("test.Echo", register)
    rt.run(main)
    """
)


class Svc:
    def __init__(self, proc: subprocess.Popen[bytes], work: Path) -> None:
        self.proc = proc
        self.work = work
        self.state_file = work / "run" / "services" / "testsvc.json"
        self.info: dict[str, Any] = {}

    def state(self) -> dict[str, Any]:
        return dict(json.loads(self.state_file.read_text()))

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.info['http_port']}"

    def output(self) -> str:
        return self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def start_service(tmp_path: Path) -> Iterator[Callable[[str], Svc]]:
    started: list[Svc] = []

    def start(mode: str = "ok") -> Svc:
        work = tmp_path / f"svc{len(started)}"
        work.mkdir()
        script = work / "svc.py"
        script.write_text(SERVICE_SCRIPT)
        env = {**os.environ, "PYTHONPATH": str(REPO), "TEST_TOKEN": TOKEN}
        proc = subprocess.Popen(
            [sys.executable, str(script), str(work), mode, str(MAX_MSG), str(MAX_BODY)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        svc = Svc(proc, work)
        started.append(svc)
        if mode == "ok":

            def bound() -> bool:
                assert proc.poll() is None, f"service exited early:\n{svc.output()}"
                return svc.state_file.exists() and svc.state().get("http_port") is not None

            wait_for(bound, 15, "the service to bind its ports")
            svc.info = svc.state()
        return svc

    yield start
    for svc in started:
        if svc.proc.poll() is None:
            svc.proc.kill()
            svc.proc.wait(timeout=5)


def grpc_health(port: int, service: str = "") -> int:
    async def check() -> int:
        async with make_channel("127.0.0.1", port, MAX_MSG) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            return int(resp.status)

    return asyncio.run(check())


def echo_call(port: int, payload: bytes, token: str | None) -> bytes:
    async def call() -> bytes:
        # The client may send more than the server accepts, to test the server's limit.
        async with make_channel("127.0.0.1", port, 4 * MAX_MSG) as ch:
            method = ch.unary_unary("/test.Echo/Echo")
            out: bytes = await rpc(method, payload, timeout_s=3, idempotent=False, token=token)
            return out

    return asyncio.run(call())


def test_service_serves_reports_readiness_enforces_limits_and_drains_on_http(
    start_service: Callable[[str], Svc],
) -> None:
    svc = start_service("ok")
    grpc_port = int(svc.info["grpc_port"])
    assert svc.info["pid"] == svc.proc.pid
    assert svc.info["host"] == "127.0.0.1"
    assert grpc_port > 0 and svc.info["http_port"] > 0
    with httpx.Client(base_url=svc.http, timeout=5) as http:
        assert http.get("/healthz").status_code == 200

        # Not ready until the service says so: 503 with its reasons, gRPC health NOT_SERVING.
        r = http.get("/readyz")
        assert r.status_code == 503
        assert r.json()["reasons"] == ["model not loaded"]
        assert grpc_health(grpc_port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert grpc_health(grpc_port, "test.Echo") == health_pb2.HealthCheckResponse.NOT_SERVING

        # gRPC auth: health is open, everything else needs the token.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            echo_call(grpc_port, b"hi", token=None)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            echo_call(grpc_port, b"hi", token="wrong")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert echo_call(grpc_port, b"hi", token=TOKEN) == b"hi"

        # Size limits: gRPC from flow.max_message_bytes, HTTP bodies from max_http_body_bytes.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            echo_call(grpc_port, b"x" * (MAX_MSG + 1), token=TOKEN)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        big = http.post("/v1/drain", content=b"x" * (MAX_BODY + 1), headers={"authorization": f"Bearer {TOKEN}"})
        assert big.status_code == 413
        assert svc.proc.poll() is None  # the refused request did not drain it

        # The service marks itself ready.
        (svc.work / "ready").touch()
        wait_for(lambda: http.get("/readyz").status_code == 200, 5, "/readyz 200")
        wait_for(
            lambda: grpc_health(grpc_port, "test.Echo") == health_pb2.HealthCheckResponse.SERVING,
            5,
            "gRPC health SERVING",
        )
        assert grpc_health(grpc_port) == health_pb2.HealthCheckResponse.SERVING
        assert svc.state()["state"] == "ready"

        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        for name in METRIC_NAMES:
            assert name.removesuffix("_total") in metrics.text, name
        assert 'rlfleet_tokens_total{phase="generate",service="testsvc"} 5.0' in metrics.text
        assert 'rlfleet_ready{service="testsvc"} 1.0' in metrics.text

        status = http.get("/v1/status").json()
        assert status["state"] == "ready"
        assert status["detail"] == {"step": 1}
        assert status["grpc_port"] == grpc_port

        # Admin route: no token, wrong token -> 401; right token -> accepted, then a clean exit.
        assert http.post("/v1/drain").status_code == 401
        assert http.post("/v1/drain", headers={"authorization": "Bearer nope"}).status_code == 401
        r = http.post("/v1/drain", headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 202, r.text
    assert svc.proc.wait(timeout=10) == 0, svc.output()
    assert (svc.work / "drained").read_text() == "ok"
    assert svc.state()["state"] == "stopped"


def test_sigterm_drains_and_exits_zero(start_service: Callable[[str], Svc]) -> None:
    svc = start_service("ok")
    (svc.work / "ready").touch()
    wait_for(lambda: svc.state()["state"] == "ready", 5, "ready")
    svc.proc.send_signal(signal.SIGTERM)
    assert svc.proc.wait(timeout=10) == 0, svc.output()
    assert (svc.work / "drained").read_text() == "ok"
    assert svc.state()["state"] == "stopped"


def test_main_loop_crash_exits_nonzero_quickly_without_draining(start_service: Callable[[str], Svc]) -> None:
    t0 = time.monotonic()
    svc = start_service("crash")
    code = svc.proc.wait(timeout=15)
    out = svc.output()
    assert code != 0
    assert time.monotonic() - t0 < 10
    assert not (svc.work / "drained").exists()  # no checkpoint from an unknown state
    assert svc.state()["state"] == "failed"
    assert "main loop failed" in out and "main loop blew up" in out


# --- in-process: interceptor, admin guard, body limit, rpc helper ----------------------------------


async def _serve(handlers: dict[str, grpc.RpcMethodHandler], token: str | None) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=[TokenAuthInterceptor(token)] if token else [])
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Svc", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def _echo_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield request
    yield request


def test_interceptor_refuses_missing_and_wrong_tokens_but_not_health() -> None:
    async def scenario() -> None:
        server, port = await _serve(
            {
                "Echo": grpc.unary_unary_rpc_method_handler(_echo),
                "Stream": grpc.unary_stream_rpc_method_handler(_echo_stream),
            },
            TOKEN,
        )
        try:
            async with make_channel("127.0.0.1", port, MAX_MSG) as ch:
                echo = ch.unary_unary("/test.Svc/Echo")
                for md in [None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await echo(b"x", timeout=2, metadata=md)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                ok = await echo(b"x", timeout=2, metadata=(("authorization", f"Bearer {TOKEN}"),))
                assert ok == b"x"

                # A streaming method is refused too, without hanging.
                stream = ch.unary_stream("/test.Svc/Stream")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [m async for m in stream(b"y", timeout=2)]
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                got = [m async for m in stream(b"y", timeout=2, metadata=(("authorization", f"Bearer {TOKEN}"),))]
                assert got == [b"y", b"y"]

                # Unknown methods look the same as known ones to an unauthenticated peer.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await ch.unary_unary("/test.Svc/Nope")(b"x", timeout=2)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

                health = health_pb2_grpc.HealthStub(ch)
                resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def _admin_app(token: str | None, max_body: int = MAX_BODY) -> FastAPI:
    app = FastAPI()
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body)

    @app.post("/admin", dependencies=[Depends(admin_guard(token))])
    async def admin() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"n": len(await request.body())}

    return app


def _http(app: FastAPI, client_host: str = "127.0.0.1") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(client_host, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://svc")


def test_admin_guard_needs_the_right_token() -> None:
    async def scenario() -> None:
        async with _http(_admin_app(TOKEN)) as c:
            assert (await c.post("/admin")).status_code == 401
            assert (await c.post("/admin", headers={"authorization": "Bearer wrong"})).status_code == 401
            assert (await c.post("/admin", headers={"authorization": TOKEN})).status_code == 401
            r = await c.post("/admin", headers={"authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200 and r.json() == {"ok": True}

    asyncio.run(scenario())


def test_admin_guard_without_a_token_answers_loopback_only() -> None:
    async def scenario() -> None:
        async with _http(_admin_app(None), "127.0.0.1") as c:
            assert (await c.post("/admin")).status_code == 200
        async with _http(_admin_app(None), "10.1.2.3") as c:
            assert (await c.post("/admin")).status_code == 401

    asyncio.run(scenario())


def test_body_limit_refuses_declared_and_streamed_oversized_bodies() -> None:
    async def chunks(n: int) -> AsyncIterator[bytes]:
        for _ in range(n):
            yield b"x" * 1000

    async def scenario() -> None:
        async with _http(_admin_app(TOKEN)) as c:
            assert (await c.post("/echo", content=b"x" * MAX_BODY)).json() == {"n": MAX_BODY}
            assert (await c.post("/echo", content=b"x" * (MAX_BODY + 1))).status_code == 413
            # No Content-Length: counted as it streams in.
            assert (await c.post("/echo", content=chunks(3))).json() == {"n": 3000}
            assert (await c.post("/echo", content=chunks(10))).status_code == 413

    asyncio.run(scenario())


def test_rpc_retries_only_idempotent_calls_on_unavailable() -> None:
    calls = {"n": 0}

    async def flaky(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        calls["n"] += 1
        if calls["n"] <= 2:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        return b"ok"

    async def bad(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        calls["n"] += 1
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad shape")
        return b""

    async def slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(5)
        return b"late"

    async def scenario() -> None:
        server, port = await _serve(
            {
                "Flaky": grpc.unary_unary_rpc_method_handler(flaky),
                "Bad": grpc.unary_unary_rpc_method_handler(bad),
                "Slow": grpc.unary_unary_rpc_method_handler(slow),
            },
            TOKEN,
        )
        try:
            async with make_channel("127.0.0.1", port, MAX_MSG) as ch:
                fast: dict[str, Any] = {"token": TOKEN, "backoff_s": 0.01, "timeout_s": 2}
                # Not idempotent: one attempt, the error surfaces.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await rpc(ch.unary_unary("/test.Svc/Flaky"), b"", idempotent=False, **fast)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert calls["n"] == 1
                # Idempotent: retried through the outage.
                calls["n"] = 0
                assert await rpc(ch.unary_unary("/test.Svc/Flaky"), b"", idempotent=True, **fast) == b"ok"
                assert calls["n"] == 3
                # A non-transient error is never retried.
                calls["n"] = 0
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await rpc(ch.unary_unary("/test.Svc/Bad"), b"", idempotent=True, **fast)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert calls["n"] == 1
                # Every call has a deadline; retries are bounded.
                t0 = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await rpc(
                        ch.unary_unary("/test.Svc/Slow"),
                        b"",
                        idempotent=True,
                        retries=1,
                        token=TOKEN,
                        timeout_s=0.2,
                        backoff_s=0.01,
                    )
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() - t0 < 2
                with pytest.raises(ValueError):
                    await rpc(ch.unary_unary("/test.Svc/Flaky"), b"", idempotent=True, timeout_s=0)
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_a_channel_reaches_a_peer_that_starts_late_within_a_second_not_after_grpcs_growing_backoff() -> None:
    # gRPC's default reconnect backoff (1 s growing 1.6x to 120 s) left the controller failing to reach
    # an actor for up to a minute after the actor was serving, once the actor's start had taken a
    # minute or two. 12 s of refusals is enough to tell: the default's next try came 4 s after the peer
    # was up here (attempts near 0, 1, 2.6, 5.2, 9.3, 15.8 s, +-20% jitter), the fleet's within 0.3 s.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here until the server below starts

    async def scenario() -> float:
        async with make_channel("127.0.0.1", port, MAX_MSG) as ch:
            call = ch.unary_unary("/test.Svc/Echo")
            t0 = time.monotonic()
            while time.monotonic() - t0 < 12.0:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(b"x", timeout=1.0)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(0.2)
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
                "test.Svc", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}),))
            assert server.add_insecure_port(f"127.0.0.1:{port}") == port
            await server.start()
            up = time.monotonic()
            try:
                while True:
                    try:
                        assert await call(b"x", timeout=1.0) == b"x"
                        return time.monotonic() - up
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.UNAVAILABLE
                        assert time.monotonic() - up < 10, "the peer was never reached"
                        await asyncio.sleep(0.05)
            finally:
                await server.stop(0)

    waited = asyncio.run(scenario())
    assert waited < 0.8, f"reached {waited:.2f} s after the peer started"


# --- in-process: runtime edges --------------------------------------------------------------------


def _runtime(tmp_path: Path, **kwargs: Any) -> ServiceRuntime:
    kwargs.setdefault("endpoint", Endpoint())
    return ServiceRuntime(
        "edge", run_dir=tmp_path, hard_exit=False, gpu=False, grace_s=0.5, readiness_interval_s=0.05, **kwargs
    )


@pytest.mark.parametrize("which", ["grpc_port", "http_port"])
def test_start_refuses_a_port_already_in_use(tmp_path: Path, which: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rt = _runtime(tmp_path, endpoint=Endpoint(**{which: port}))

        async def scenario() -> None:
            try:
                with pytest.raises(OSError):
                    await rt.start()
            finally:
                await rt.stop_servers(0)

        asyncio.run(scenario())


def test_readiness_lost_after_ready_turns_unready_and_not_serving(tmp_path: Path) -> None:
    reasons: list[str] = []

    async def readiness() -> list[str]:
        return list(reasons)

    rt = _runtime(tmp_path, readiness=readiness)

    async def scenario() -> None:
        await rt.start()
        try:
            assert rt.grpc_port is not None
            assert await rt.refresh_readiness() == []
            assert rt.state == "ready"
            assert grpc_health_async_status(await _health(rt.grpc_port)) == "SERVING"
            reasons.append("redis unreachable")
            assert await rt.refresh_readiness() == ["redis unreachable"]
            assert rt.state == "unready"
            assert grpc_health_async_status(await _health(rt.grpc_port)) == "NOT_SERVING"
            state = json.loads((tmp_path / "services" / "edge.json").read_text())
            assert state["state"] == "unready"
        finally:
            await rt.stop_servers(0)

    asyncio.run(scenario())


async def _health(port: int) -> int:
    async with make_channel("127.0.0.1", port, MAX_MSG) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return int(resp.status)


def grpc_health_async_status(status: int) -> str:
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(status))


def test_a_main_loop_that_returns_drains_and_exits_zero(tmp_path: Path) -> None:
    drained: list[str] = []

    async def on_drain() -> None:
        drained.append("yes")

    async def main() -> None:
        await asyncio.sleep(0.05)

    rt = _runtime(tmp_path, on_drain=on_drain)
    assert asyncio.run(rt.serve(main)) == 0
    assert drained == ["yes"]
    assert rt.state == "stopped"
    assert rt.drain_reason == "main loop finished"


def test_a_failing_on_drain_exits_nonzero(tmp_path: Path) -> None:
    async def on_drain() -> None:
        raise RuntimeError("checkpoint failed")

    async def main() -> None:
        await asyncio.sleep(0)

    rt = _runtime(tmp_path, on_drain=on_drain)
    assert asyncio.run(rt.serve(main)) == 1
    assert rt.state == "failed"

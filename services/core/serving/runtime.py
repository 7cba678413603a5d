"""The process shell every service runs in: gRPC + HTTP in one asyncio loop, readiness, drain.

A service's ``server.py`` builds its model/state, hands the runtime a few callbacks and its main
loop, and calls ``run()``:

* ``readiness()`` -> reasons the service is not ready (empty: ready). Polled, and on every
  ``/readyz``; it drives ``/readyz`` (200/503), the gRPC health status and ``rlfleet_ready``.
* ``status()`` -> a JSON-able dict shown under ``detail`` in ``/v1/status``.
* ``on_drain()`` -> stop reading, finish in-flight work, checkpoint, ack. Called once, on SIGTERM,
  SIGINT, ``POST /v1/drain`` or when the main loop returns; the process then exits 0.
* ``main()`` -> the service's own loop (consume a stream, run the step loop...). If it raises, the
  process logs it and exits 1 right away instead of lingering half-alive (a supervisor restarts it,
  and the replacement reclaims the pending work).

Lifecycle (also written to ``RUN_DIR/services/<instance>.json`` for ``rlfleet status``)::

    starting --ready()==[]--> ready <--> unready      (unready: a check failed after being ready)
        \\                      |
         +------ drain --------+--> draining --> stopped (exit 0)
    any state -- main raised / on_drain failed --> failed (exit 1)

The client side (``make_channel``, ``rpc``) lives in ``services.core.transport.rpc`` and is re-exported here;
uvicorn embedding, the watchdog and the state file in ``services.core.serving.shell``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

import grpc
import uvicorn
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from services.core.config.run import ConfigError, Endpoint, RunCannotContinue, RunConfig, ServiceName
from services.core.observability.gpu import GpuMonitor
from services.core.observability.logs import redact_text
from services.core.observability.metrics import ServiceMetrics
from services.core.serving.http_routes import install_routes
from services.core.serving.shell import (
    EmbeddedUvicorn,
    Watchdog,
    bind_tcp,
    write_state_file,
)
from services.core.transport.auth import BodySizeLimitMiddleware, TokenAuthInterceptor, admin_guard
from services.core.transport.rpc import RETRYABLE_CODES, grpc_target, is_loopback_host, make_channel, rpc

__all__ = ["RETRYABLE_CODES", "ServiceRuntime", "State", "make_channel", "rpc"]

log = logging.getLogger("rlfleet.runtime")

State = Literal["starting", "ready", "unready", "draining", "stopped", "failed"]
ReadinessFn = Callable[[], Awaitable[Sequence[str]]]
StatusFn = Callable[[], Awaitable[Mapping[str, Any]]]
DrainFn = Callable[[], Awaitable[None]]
MainFn = Callable[[], Coroutine[Any, Any, None]]
RegisterFn = Callable[[grpc.aio.Server], None]

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_ENDED: tuple[State, ...] = ("draining", "stopped", "failed")


class ServiceRuntime:
    """gRPC server + FastAPI app + lifecycle for one service process. See the module docstring."""

    def __init__(
        self,
        service: str,
        *,
        endpoint: Endpoint | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        token: str | None = None,
        readiness: ReadinessFn | None = None,
        status: StatusFn | None = None,
        on_drain: DrainFn | None = None,
        instance: str | None = None,
        max_http_body_bytes: int = 1024 * 1024,
        grace_s: float = 5.0,
        drain_timeout_s: float = 120.0,
        readiness_interval_s: float = 1.0,
        readiness_timeout_s: float = 5.0,
        fail_exit_s: float = 5.0,
        hard_exit: bool = True,
        metrics: ServiceMetrics | None = None,
        gpu: GpuMonitor | bool = True,
    ) -> None:
        self.service = service
        self.instance = instance or service
        self.endpoint = endpoint or Endpoint()
        self.host = self.endpoint.host
        self.max_message_bytes = max_message_bytes
        self.readiness = readiness
        self.status = status
        self.on_drain = on_drain
        self.grace_s = grace_s
        self.drain_timeout_s = drain_timeout_s
        self.readiness_interval_s = readiness_interval_s
        self.readiness_timeout_s = readiness_timeout_s
        self.fail_exit_s = fail_exit_s
        # False only for in-process tests: a hung shutdown would otherwise os._exit the test runner.
        self.hard_exit = hard_exit
        self._token = token or None
        self.state_file = Path(run_dir) / "services" / f"{self.instance}.json" if run_dir is not None else None

        self.metrics = metrics or ServiceMetrics(service)
        self.gpu: GpuMonitor | None = gpu if isinstance(gpu, GpuMonitor) else GpuMonitor(self.metrics) if gpu else None

        self.state: State = "starting"
        self.reasons: list[str] = ["starting"]
        self.started_at = time.time()
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.exit_code: int | None = None

        self._grpc_services: list[tuple[str, RegisterFn]] = []
        self._grpc_server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._uvicorn: EmbeddedUvicorn | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._drain_event = asyncio.Event()
        self.drain_reason: str | None = None
        self._ready_lock = asyncio.Lock()
        self._serving = False  # both servers up; readiness is only meaningful after that
        self._signals_installed: list[signal.Signals] = []

        # Admin routes: `Depends(runtime.require_admin)`.
        self.require_admin = admin_guard(self._token)
        self.app = FastAPI(title=f"rlfleet {service}", docs_url=None, redoc_url=None, openapi_url=None)
        self.app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_http_body_bytes)
        install_routes(self)

    @classmethod
    def from_config(cls, cfg: RunConfig, service: ServiceName, **kwargs: Any) -> ServiceRuntime:
        """Endpoint, run dir, message size limit and token from the run config."""
        # A replica (`--replica K`) shares its service's consumer group but not its identity.
        kwargs.setdefault("instance", os.environ.get("RLFLEET_INSTANCE") or None)
        return cls(
            service,
            endpoint=cfg.endpoint(service),
            run_dir=cfg.run_dir,
            max_message_bytes=cfg.flow.max_message_bytes,
            token=cfg.token(),
            **kwargs,
        )

    # -- hooks -------------------------------------------------------------------------------------

    def add_grpc_service(self, name: str, register: RegisterFn) -> None:
        """Register servicers before `serve()`.

        `name` is the full proto service name (``rlfleet.v1.Actor``): its grpc.health.v1 status
        follows readiness, as does the server-wide status "".
        `register(server)` adds the servicer, e.g. ``lambda s: pb_grpc.add_ActorServicer_to_server(x, s)``.
        """
        if self._grpc_server is not None:
            raise RuntimeError("add_grpc_service must be called before serve()/start()")
        self._grpc_services.append((name, register))

    # -- HTTP ----------------------------------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        return {"service": self.service, "instance": self.instance, "state": self.state, "pid": os.getpid(),
                "host": self.host, "grpc_port": self.grpc_port, "http_port": self.http_port,
                "started_at": self.started_at}

    async def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self._identity(), "ready": self.state == "ready", "reasons": list(self.reasons),
                               "uptime_s": round(time.time() - self.started_at, 3)}
        if self.status is not None:
            try:
                out["detail"] = dict(await asyncio.wait_for(self.status(), self.readiness_timeout_s))
            except Exception as e:  # status is informational; never turn it into a 500
                out["detail_error"] = type(e).__name__
        return out

    # -- state ---------------------------------------------------------------------------------------

    def _set_state(self, state: State) -> None:
        previous, self.state = self.state, state
        self.metrics.ready.set(1 if state == "ready" else 0)
        if previous != state:
            log.info("state changed", extra={"from": previous, "to": state, "instance": self.instance})
        self._write_state_file()

    def _write_state_file(self) -> None:
        if self.state_file is None:
            return
        write_state_file(self.state_file, {**self._identity(), "updated_at": time.time()})

    async def _set_health(self, serving: bool) -> None:
        if self._health is None:
            return
        status = _SERVING if serving else _NOT_SERVING
        for name in ("", *(n for n, _ in self._grpc_services)):
            await self._health.set(name, status)

    async def refresh_readiness(self) -> list[str]:
        """Run the readiness check now and apply it (state, gRPC health, metric). Returns reasons.

        Services may call this right after loading a model to report ready without waiting for the
        next poll.
        """
        async with self._ready_lock:
            if self.state in _ENDED:
                return [self.state]
            if not self._serving:
                return ["starting"]
            reasons = await self._evaluate_readiness()
            if self.state in _ENDED:  # a drain began while the check ran
                return [self.state]
            self.reasons = reasons
            if not reasons and self.state != "ready":
                await self._set_health(True)
                self._set_state("ready")
            elif reasons and self.state == "ready":
                log.warning("not ready any more", extra={"reasons": reasons})
                await self._set_health(False)
                self._set_state("unready")
            return reasons

    async def _evaluate_readiness(self) -> list[str]:
        if self.readiness is None:
            return []
        try:
            return [str(r) for r in await asyncio.wait_for(self.readiness(), self.readiness_timeout_s)]
        except TimeoutError:
            return [f"readiness check took over {self.readiness_timeout_s}s"]
        except Exception as e:
            return [redact_text(f"readiness check raised {type(e).__name__}: {e}")[:300]]

    async def _readiness_loop(self) -> None:
        # Polled so gRPC health follows readiness even when nobody probes /readyz.
        while True:
            try:
                await self.refresh_readiness()
            except Exception:
                log.exception("readiness poll failed")
            await asyncio.sleep(self.readiness_interval_s)

    # -- lifecycle -----------------------------------------------------------------------------------

    def request_drain(self, reason: str) -> None:
        """Begin a graceful drain (idempotent). Safe from signal handlers and request handlers."""
        if self._drain_event.is_set():
            return
        self.drain_reason = reason
        log.info("drain requested", extra={"reason": reason})
        self._drain_event.set()

    @property
    def draining(self) -> bool:
        return self._drain_event.is_set()

    async def start(self) -> None:
        """Bind and start gRPC and HTTP; returns once both accept connections."""
        if self._grpc_server is not None:
            raise RuntimeError("runtime already started")
        if not is_loopback_host(self.host) and self._token is None:
            log.warning(
                "listening beyond loopback without a token: gRPC is open, admin routes answer loopback only",
                extra={"host": self.host},
            )

        options = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # gRPC enables SO_REUSEPORT by default, which lets a second copy of a service bind the same
            # port and silently share its traffic. A taken port must be an error.
            ("grpc.so_reuseport", 0),
        ]
        interceptors = [TokenAuthInterceptor(self._token)] if self._token else []
        server = grpc.aio.server(interceptors=interceptors, options=options)
        self._grpc_server = server
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        for _, register in self._grpc_services:
            register(server)
        await self._set_health(False)  # NOT_SERVING until readiness says otherwise
        target = grpc_target(self.host, self.endpoint.grpc_port)
        try:
            port = server.add_insecure_port(target)
        except RuntimeError:
            port = 0
        if not port:
            # Drop every reference to the never-started server: grpc.aio only stops its poller thread
            # when the object is freed, and a poller alive at interpreter exit crashes the shutdown.
            self._grpc_server = self._health = None
            del server
            raise OSError(f"cannot bind gRPC on {target}: address in use or not available")
        self.grpc_port = int(port)
        await server.start()

        sock = bind_tcp(self.host, self.endpoint.http_port)
        self.http_port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            log_config=None,  # logs go through services.core.observability.logs (JSON lines)
            access_log=False,  # probes every second would drown the service's own log lines
            lifespan="off",
            timeout_graceful_shutdown=max(1, math.ceil(self.grace_s)),
        )
        self._uvicorn = EmbeddedUvicorn(config)
        self._http_task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]), name="http")
        deadline = time.monotonic() + 10.0
        while not self._uvicorn.started:
            if self._http_task.done():
                self._http_task.result()  # raises what stopped it
                raise OSError("HTTP server stopped during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError("HTTP server did not start within 10s")
            await asyncio.sleep(0.01)
        self._serving = True
        self.started_at = time.time()
        self._set_state("starting")
        log.info(
            "serving",
            extra={
                "host": self.host,
                "grpc_port": self.grpc_port,
                "http_port": self.http_port,
                "token_required": self._token is not None,
            },
        )

    async def stop_servers(self, grace_s: float) -> None:
        """Stop gRPC (in-flight calls get `grace_s`) and HTTP; idempotent."""
        self._serving = False
        tasks: list[Awaitable[Any]] = []
        if self._grpc_server is not None:
            tasks.append(self._grpc_server.stop(grace_s))
        if self._uvicorn is not None and self._http_task is not None:
            self._uvicorn.should_exit = True
            tasks.append(asyncio.wait_for(asyncio.shield(self._http_task), grace_s + 2.0))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                log.warning("server stop did not finish cleanly", extra={"error": type(r).__name__})
        if self._http_task is not None and not self._http_task.done():
            self._http_task.cancel()
        if self.gpu is not None:
            self.gpu.close()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals only reach the main thread; the embedder handles them
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._signals_installed.append(sig)

    def _remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._signals_installed:
            loop.remove_signal_handler(sig)
        self._signals_installed.clear()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.draining and self.hard_exit:
            # A second signal means "now": an operator pressing Ctrl-C twice, or a supervisor that
            # lost patience. The state file keeps saying "draining", which is what happened.
            log.warning("second signal during drain, exiting now", extra={"signal": sig.name})
            Watchdog._fire(1, f"second {sig.name}")
        self.request_drain(f"signal {sig.name}")

    async def serve(self, main: MainFn | None = None) -> int:
        """Run until drained or failed; returns the process exit code (0 drained, 1 failed)."""
        self._install_signal_handlers()
        try:
            try:
                await self.start()
            except Exception:
                log.exception("start-up failed")
                return await self._fail("start-up failed")

            poller = asyncio.create_task(self._readiness_loop(), name="readiness")
            main_task = asyncio.create_task(main(), name="main") if main is not None else None
            drain_wait = asyncio.create_task(self._drain_event.wait(), name="drain-wait")
            assert self._http_task is not None
            waiters: set[asyncio.Task[Any]] = {drain_wait, self._http_task}
            if main_task is not None:
                waiters.add(main_task)
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                if main_task is not None and main_task.done() and not self.draining:
                    exc = None if main_task.cancelled() else main_task.exception()
                    if exc is not None or main_task.cancelled():
                        log.error("main loop failed", exc_info=exc)
                        return await self._fail("main loop failed", exc)
                    # A main loop that returns has finished its work (the controller after
                    # max_steps): leave the same way as on SIGTERM.
                    self.request_drain("main loop finished")
                if not self.draining:
                    log.error("HTTP server stopped unexpectedly")
                    return await self._fail("HTTP server stopped")
                return await self._drain(main_task)
            finally:
                leftovers = {t for t in (poller, drain_wait, main_task) if t is not None and not t.done()}
                for t in leftovers:
                    t.cancel()
                if leftovers:  # bounded: a task that swallows cancellation must not hold the exit
                    await asyncio.wait(leftovers, timeout=self.grace_s)
        finally:
            self._remove_signal_handlers()

    async def _drain(self, main_task: asyncio.Task[None] | None) -> int:
        watchdog = Watchdog(self.drain_timeout_s + 2 * self.grace_s + 10.0, 1, "drain") if self.hard_exit else None
        t0 = time.monotonic()
        async with self._ready_lock:
            self._set_state("draining")
            self.reasons = ["draining"]
            if self._health is not None:
                await self._health.enter_graceful_shutdown()  # NOT_SERVING for every service name
        code = 0
        if self.on_drain is not None:
            try:
                await asyncio.wait_for(self.on_drain(), self.drain_timeout_s)
            except TimeoutError:
                log.error("on_drain did not finish in time", extra={"timeout_s": self.drain_timeout_s})
                code = 1
            except Exception:
                log.exception("on_drain failed")
                code = 1
        if main_task is not None:
            code = max(code, await self._finish_main(main_task))
        await self.stop_servers(self.grace_s)
        self._set_state("stopped" if code == 0 else "failed")
        log.info(
            "drained",
            extra={
                "exit_code": code,
                "seconds": round(time.monotonic() - t0, 3),
                "reason": self.drain_reason,
            },
        )
        if watchdog is not None:
            watchdog.cancel()
        self.exit_code = code
        return code

    async def _finish_main(self, main_task: asyncio.Task[None]) -> int:
        # on_drain told the main loop to stop; give it the grace period to notice, then cancel it.
        done, _ = await asyncio.wait({main_task}, timeout=self.grace_s)
        if not done:
            log.warning("main loop still running after drain, cancelling", extra={"grace_s": self.grace_s})
            main_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({main_task}, timeout=self.grace_s)
            return 0
        if main_task.cancelled():
            return 0
        exc = main_task.exception()
        if exc is not None:
            log.error("main loop failed during drain", exc_info=exc)
            return 1
        return 0

    async def _fail(self, why: str, exc: BaseException | None = None) -> int:
        code = 2 if isinstance(exc, ConfigError | RunCannotContinue) else 1  # 2: a restart cannot help
        watchdog = Watchdog(self.fail_exit_s, code, why) if self.hard_exit else None
        self._set_state("failed")
        self.reasons = [why]
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        # A short grace: in-flight callers get an error now rather than a hang until their deadline.
        await self.stop_servers(min(1.0, self.grace_s))
        if watchdog is not None:
            watchdog.cancel()
        self.exit_code = code
        return code

    def run(self, main: MainFn | None = None) -> NoReturn:
        """Serve in a fresh event loop and exit the process with its code."""

        async def serve_then_guard_exit() -> int:
            code = await self.serve(main)
            if self.hard_exit:
                # asyncio.run still joins the default executor and the interpreter joins non-daemon
                # threads; a wedged to_thread call (a hung driver call) would block either forever.
                # Whatever happens, the exit code reaches the supervisor within a few seconds.
                Watchdog(self.fail_exit_s + self.grace_s, code, "interpreter exit")
            return code

        sys.exit(asyncio.run(serve_then_guard_exit()))

"""Shared-token authentication for gRPC and the HTTP admin routes, and the HTTP body size limit.

Services bind loopback by default and then need no token. A cross-host deployment sets
`security.token_env`; the token then travels as `authorization: Bearer <token>` (gRPC metadata and
HTTP header alike) and is compared in constant time. The gRPC health service stays open so load
balancers and `grpc_health_probe` work without the secret.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from fastapi import HTTPException, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
AUTH_METADATA_KEY = "authorization"


def bearer(token: str) -> str:
    return f"Bearer {token}"


def token_matches(presented: str | None, expected: str) -> bool:
    """Constant-time check of an `authorization` value (``Bearer <token>``) against the token."""
    if not presented:
        return False
    scheme, _, value = presented.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    # compare_digest on bytes: constant time in the length of the expected token, whatever matches.
    return hmac.compare_digest(value.strip().encode(), expected.encode())


def _metadata_value(metadata: Sequence[Any] | None, key: str) -> str | None:
    for item in metadata or ():
        # grpc.aio passes (key, value) tuples or _Metadatum objects with .key/.value.
        k, v = (item.key, item.value) if hasattr(item, "key") else item
        if k == key:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


# --- gRPC -----------------------------------------------------------------------------------------


async def _deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")


async def _deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")
    yield  # pragma: no cover  (makes this an async generator for response-streaming methods)


def _denying_handler(real: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    # The refusal must have the same streaming shape as the real method, or the server would wait
    # for a request message the client never sends. No deserializer: the body is never parsed.
    req_stream = bool(real and real.request_streaming)
    resp_stream = bool(real and real.response_streaming)
    if req_stream and resp_stream:
        return grpc.stream_stream_rpc_method_handler(_deny_stream)
    if req_stream:
        return grpc.stream_unary_rpc_method_handler(_deny_unary)
    if resp_stream:
        return grpc.unary_stream_rpc_method_handler(_deny_stream)
    return grpc.unary_unary_rpc_method_handler(_deny_unary)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless it carries ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenAuthInterceptor needs a non-empty token; install none when unset")
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method  # type: ignore[attr-defined]
        if method.startswith(HEALTH_METHOD_PREFIX):
            return await continuation(handler_call_details)
        presented = _metadata_value(handler_call_details.invocation_metadata, AUTH_METADATA_KEY)  # type: ignore[attr-defined]
        if token_matches(presented, self._token):
            return await continuation(handler_call_details)
        # Unknown methods are refused the same way, so an unauthenticated peer cannot map the API.
        return _denying_handler(await continuation(handler_call_details))


# --- HTTP admin routes ----------------------------------------------------------------------------


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_guard(token: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency for admin routes: ``dependencies=[Depends(admin_guard(token))]``.

    With a token configured, the request needs ``Authorization: Bearer <token>`` (401 otherwise).
    Without one, admin routes answer loopback clients only: a service bound to a public address with
    no token configured must not let anyone on the network drain it.
    """

    async def require_admin(request: Request) -> None:
        if token is None:
            if _is_loopback(request.client.host if request.client else None):
                return
            raise HTTPException(
                status_code=401,
                detail="admin routes need a token (security.token_env) when called from another host",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not token_matches(request.headers.get("authorization"), token):
            raise HTTPException(
                status_code=401, detail="missing or invalid token", headers={"WWW-Authenticate": "Bearer"}
            )

    return require_admin


# --- HTTP body size limit -------------------------------------------------------------------------


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=f"request body over the {limit} byte limit")


class BodySizeLimitMiddleware:
    """Answers 413 to any request body over `max_bytes`.

    A declared Content-Length over the limit is refused before the app runs, so the body is never
    read. A chunked body is counted as it streams in; crossing the limit raises `BodyTooLarge` (an
    HTTPException, which FastAPI turns into the 413 wherever the body is being read), and a refusal
    that escapes the app is answered here if no response has started yet.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._reject(scope, receive, send)
            return

        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse({"detail": f"request body over the {self.max_bytes} byte limit"}, 413)
        # Tell the client we will not read the rest of the body and the connection will not be reused.
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None

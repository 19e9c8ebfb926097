"""The HTTP API: the routes, status codes and error envelopes the pandastack SDK expects.

``create_app`` wires one router per resource (``routes/``) to a shared
``SandboxManager``. Every error is ``{"error": "..."}`` (FastAPI's own 404/405/422
included), bodies are parsed by hand so malformed JSON is a clear 400, and bearer
auth guards everything under ``/v1``.
"""

from __future__ import annotations

import hmac
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from pandastack_local import __version__, agent_client, metrics
from pandastack_local.api import foreign, openapi
from pandastack_local.api.routes import ROUTERS
from pandastack_local.api.routes.deps import error
from pandastack_local.config import ServerConfig
from pandastack_local.limits import MiB, StreamBudget
from pandastack_local.manager import ApiError, SandboxManager


def bearer_token(scope: Any) -> bytes:
    """The token as the real server takes it: ``Authorization: Bearer T`` (scheme in any case),
    else ``?access_token=T`` (for clients that cannot set headers: EventSource, WebSocket)."""
    parts = dict(scope["headers"]).get(b"authorization", b"").split()
    if len(parts) == 2 and parts[0].lower() == b"bearer":
        return bytes(parts[1])
    for pair in scope.get("query_string", b"").split(b"&"):
        key, _, value = pair.partition(b"=")
        if key == b"access_token" and value.strip():
            return urllib.parse.unquote_to_bytes(value.strip())
    return b""


class BearerAuth:
    """Pure ASGI auth for /v1 (no BaseHTTPMiddleware: it would buffer SSE streams)."""

    def __init__(self, app: Any, expected: bytes) -> None:
        self.app = app
        self.expected = expected

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            token = bearer_token(scope)
            detail = None
            if not token:
                detail = "missing bearer token"
            elif not hmac.compare_digest(b"Bearer " + token, self.expected):
                detail = "invalid api token"
            if detail is not None:
                await error(401, "unauthorized", detail=detail)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error(exc.status, exc.message, exc.headers)


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = {404: "not found", 405: "method not allowed"}.get(exc.status_code, str(exc.detail))
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(allowed_methods(request))
    return error(exc.status_code, message, headers)


METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path (Starlette's 405 names only the first
    matching route's, and FastAPI makes one route per method)."""
    routes = request.app.router.routes
    return [
        m for m in METHODS if any(r.matches({**request.scope, "method": m})[0] is Match.FULL for r in routes)
    ]


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error(400, f"invalid request: {exc.errors()}")


async def agent_gone(request: Request, exc: Exception) -> JSONResponse:
    return error(500, str(exc))


def create_app(config: ServerConfig) -> FastAPI:
    manager = SandboxManager(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await manager.start()
        try:
            yield
        finally:
            await manager.close()

    app = FastAPI(
        title="pandastack-local", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.manager = manager
    app.state.stream_budget = StreamBudget(config.stream_buffer_mb * MiB)
    app.add_middleware(BearerAuth, expected=f"Bearer {config.api_key}".encode())
    metrics.install(
        app, manager, f"Bearer {config.api_key}".encode(), config.metrics_without_key, bearer_token
    )
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(agent_client.AgentUnavailable, agent_gone)
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(foreign.router)
    openapi.install(app)
    return app

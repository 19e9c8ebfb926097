"""The HTTP API: the routes, status codes and error envelopes the pandastack SDK expects.

Every error is ``{"error": "..."}`` (FastAPI's own 404/405/422 included), bodies
are parsed by hand so malformed JSON is a clear 400, and bearer auth guards
everything under ``/v1``.
"""

from __future__ import annotations

import codecs
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import __version__, agent_client
from .agent import JSON, STDERR, STDOUT
from .config import ServerConfig
from .manager import DEFAULT_TTL_SECONDS, ApiError, Sandbox, SandboxManager, rfc3339
from .templates import TEMPLATE_NAME_RE

log = logging.getLogger("pandastack_local")

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_EXEC_OUTPUT = 16 * 1024 * 1024
LOG_OUTPUT_BYTES = 4096


def error(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)


async def json_body(request: Request, *, required: bool = True) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise ApiError(400, "invalid JSON body: empty")
        return {}
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "invalid JSON body: expected an object")
    return data


def _int_field(body: dict[str, Any], key: str, default: int | None = None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key} must be an integer")
    return value


def guest_path(request: Request) -> str:
    """Validate ``?path=``: absolute, no '..' component, no NUL. Resolution happens inside the sandbox."""
    path = request.query_params.get("path")
    if not path:
        raise ApiError(400, "path required")
    if "\x00" in path:
        raise ApiError(400, "path must not contain NUL bytes")
    if not path.startswith("/"):
        raise ApiError(500, "path must be absolute")
    if ".." in path.split("/"):
        raise ApiError(400, "path must not contain '..' components")
    return path


class BearerAuth:
    """Pure ASGI auth for /v1 (no BaseHTTPMiddleware: it would buffer SSE streams)."""

    def __init__(self, app: Any, expected: bytes) -> None:
        self.app = app
        self.expected = expected

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            detail = None
            if not header.startswith(b"Bearer ") or not header[7:].strip():
                detail = "missing bearer token"
            elif not hmac.compare_digest(header, self.expected):
                detail = "invalid api token"
            if detail is not None:
                await error(401, "unauthorized", detail=detail)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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

    app.add_middleware(BearerAuth, expected=f"Bearer {config.api_key}".encode())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error(exc.status, exc.message, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: "not found", 405: "method not allowed"}.get(exc.status_code, str(exc.detail))
        return error(exc.status_code, message, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, f"invalid request: {exc.errors()}")

    @app.exception_handler(agent_client.AgentUnavailable)
    async def agent_gone(request: Request, exc: agent_client.AgentUnavailable) -> JSONResponse:
        return error(500, str(exc))

    # ---- unauthenticated ------------------------------------------------------
    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "sandboxes": len(manager.sandboxes)}

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": __version__, "server": "pandastack-local", "isolation": manager.cgroups.summary()}

    # ---- sandboxes ------------------------------------------------------------
    @app.post("/v1/sandboxes")
    async def create_sandbox(request: Request) -> JSONResponse:
        body = await json_body(request, required=False)
        name = body.get("template", "code-interpreter")
        if not isinstance(name, str) or not TEMPLATE_NAME_RE.match(name):
            raise ApiError(400, "invalid template name (allowed: [A-Za-z0-9._-], at most 64 chars)")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise ApiError(400, "metadata must be a map of string to string")
        ttl = _int_field(body, "ttl_seconds")
        if ttl is not None and ttl < 0:
            raise ApiError(500, "ttl_seconds must not be negative")
        persistent = bool(body.get("persistent", False))
        template = manager.template(name)
        sb = await manager.create(template, metadata, ttl or DEFAULT_TTL_SECONDS, persistent)
        return JSONResponse(sb.to_json(), status_code=201)

    @app.get("/v1/sandboxes")
    async def list_sandboxes() -> JSONResponse:
        return JSONResponse([sb.to_json() for sb in manager.sandboxes.values()])

    @app.get("/v1/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str) -> JSONResponse:
        return JSONResponse(manager.get(sandbox_id).to_json())

    @app.delete("/v1/sandboxes/{sandbox_id}")
    async def delete_sandbox(sandbox_id: str) -> Response:
        await manager.delete(sandbox_id)
        return Response(status_code=204)

    # ---- exec -----------------------------------------------------------------
    async def exec_request(request: Request, sandbox_id: str) -> tuple[Sandbox, dict[str, Any]]:
        sb = manager.get(sandbox_id)
        body = await json_body(request)
        cmd = body.get("cmd")
        if not isinstance(cmd, str) or not cmd.strip():
            raise ApiError(400, "cmd required")
        timeout = _int_field(body, "timeout_seconds", 0) or 0
        if timeout < 0:
            raise ApiError(400, "timeout_seconds must not be negative")
        manager.running(sandbox_id)
        sb.log(f"$ {cmd}")
        return sb, {"op": "exec", "cmd": cmd, "timeout_seconds": timeout}

    @app.post("/v1/sandboxes/{sandbox_id}/exec")
    async def exec_cmd(sandbox_id: str, request: Request) -> JSONResponse:
        sb, req = await exec_request(request, sandbox_id)
        out: dict[int, bytearray] = {STDOUT: bytearray(), STDERR: bytearray()}
        started = time.monotonic()
        with manager.activity(sb):
            conn = await agent_client.Connection.open(sb.process.socket_path, req)
            try:
                final: dict[str, Any] = {}
                async for kind, payload in conn.frames():
                    if kind in out and len(out[kind]) < MAX_EXEC_OUTPUT:
                        out[kind] += payload[: MAX_EXEC_OUTPUT - len(out[kind])]
                    elif kind == JSON:
                        final = payload
            except agent_client.AgentUnavailable:
                await manager.agent_lost(sb)
                raise
            finally:
                conn.close()
        stdout = out[STDOUT].decode("utf-8", "replace")
        stderr = out[STDERR].decode("utf-8", "replace")
        if stdout or stderr:
            sb.log((stdout + stderr)[:LOG_OUTPUT_BYTES])
        if "error" in final:
            sb.log(f"error: {final['error']}")
            raise ApiError(500, str(final["error"]))
        sb.log(f"exit {final.get('exit_code')}")
        return JSONResponse(
            {
                "stdout": stdout,
                "stderr": stderr,
                "exit_code": int(final.get("exit_code", -1)),
                "duration_ms": int((time.monotonic() - started) * 1000),
            }
        )

    @app.post("/v1/sandboxes/{sandbox_id}/exec/stream")
    async def exec_stream(sandbox_id: str, request: Request) -> StreamingResponse:
        sb, req = await exec_request(request, sandbox_id)
        conn = await agent_client.Connection.open(sb.process.socket_path, req)

        def sse(event: str, data: dict[str, Any]) -> str:
            return f"event: {event}\ndata: {json.dumps(data)}\n\n"

        async def events() -> AsyncIterator[str]:
            decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in (STDOUT, STDERR)}
            names = {STDOUT: "stdout", STDERR: "stderr"}
            with manager.activity(sb):
                try:
                    async for kind, payload in conn.frames():
                        if kind in decoders:
                            text = decoders[kind].decode(payload)
                            if text:
                                yield sse(names[kind], {"chunk": text})
                        elif kind == JSON:
                            for k, dec in decoders.items():
                                tail = dec.decode(b"", final=True)
                                if tail:
                                    yield sse(names[k], {"chunk": tail})
                            if "error" in payload:
                                sb.log(f"error: {payload['error']}")
                                yield sse("error", {"error": str(payload["error"])})
                            else:
                                sb.log(f"exit {payload.get('exit_code')}")
                                yield sse("exit", {"exit_code": int(payload.get("exit_code", -1))})
                except agent_client.AgentUnavailable as exc:
                    await manager.agent_lost(sb)
                    yield sse("error", {"error": str(exc)})
                finally:
                    conn.close()

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    # ---- filesystem -----------------------------------------------------------
    def fs_error(exc: agent_client.AgentError, *, missing_status: int = 500) -> ApiError:
        if exc.errno == "ENOENT":
            return ApiError(missing_status, "file does not exist" if missing_status == 404 else str(exc))
        if exc.errno == "ENOSPC":
            return ApiError(507, str(exc))
        return ApiError(500, str(exc))

    async def agent_fs(
        sb: Sandbox, call: Callable[[Path], Awaitable[Any]], *, missing_status: int = 500
    ) -> Any:
        """One file operation by the sandbox's agent: running check, activity, errors mapped."""
        manager.running(sb.id)
        with manager.activity(sb):
            try:
                return await call(sb.process.socket_path)
            except agent_client.AgentError as exc:
                raise fs_error(exc, missing_status=missing_status) from exc

    @app.get("/v1/sandboxes/{sandbox_id}/fs")
    async def fs_read(sandbox_id: str, request: Request) -> Response:
        sb = manager.get(sandbox_id)
        path = guest_path(request)
        data = await agent_fs(sb, lambda sock: agent_client.read_file(sock, path))
        return Response(data, media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/fs")
    async def fs_write(sandbox_id: str, request: Request) -> JSONResponse:
        sb = manager.get(sandbox_id)
        path = guest_path(request)
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise ApiError(400, f"request body too large: max {MAX_BODY_BYTES} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(400, f"request body too large: max {MAX_BODY_BYTES} bytes")
        result = await agent_fs(sb, lambda sock: agent_client.write_file(sock, path, bytes(body)))
        return JSONResponse({"path": path, "bytes": int(result.get("bytes", len(body)))})

    @app.get("/v1/sandboxes/{sandbox_id}/fs/dir")
    async def fs_list(sandbox_id: str, request: Request) -> JSONResponse:
        sb = manager.get(sandbox_id)
        path = guest_path(request)
        result = await agent_fs(sb, lambda sock: agent_client.call(sock, {"op": "list", "path": path}))
        return JSONResponse({"path": path, "entries": result["entries"]})

    @app.get("/v1/sandboxes/{sandbox_id}/fs/stat")
    async def fs_stat(sandbox_id: str, request: Request) -> JSONResponse:
        sb = manager.get(sandbox_id)
        path = guest_path(request)
        result = await agent_fs(
            sb, lambda sock: agent_client.call(sock, {"op": "stat", "path": path}), missing_status=404
        )
        return JSONResponse(result["entry"])

    @app.delete("/v1/sandboxes/{sandbox_id}/fs")
    async def fs_delete(sandbox_id: str, request: Request) -> Response:
        sb = manager.get(sandbox_id)
        path = guest_path(request)
        if path.rstrip("/") == "":
            raise ApiError(400, "refusing to delete /")
        await agent_fs(sb, lambda sock: agent_client.call(sock, {"op": "delete", "path": path}))
        return Response(status_code=204)

    # ---- lifecycle, pause, logs, fork -------------------------------------------
    @app.get("/v1/sandboxes/{sandbox_id}/lifecycle")
    async def get_lifecycle(sandbox_id: str) -> JSONResponse:
        return JSONResponse(manager.lifecycle(manager.get(sandbox_id)))

    @app.patch("/v1/sandboxes/{sandbox_id}/lifecycle")
    async def patch_lifecycle(sandbox_id: str, request: Request) -> JSONResponse:
        sb = manager.get(sandbox_id)
        body = await json_body(request)
        ttl = _int_field(body, "ttl_seconds")
        if ttl is not None and ttl < 0:
            raise ApiError(400, "ttl_seconds must not be negative")
        persistent = body.get("persistent")
        if persistent is not None and not isinstance(persistent, bool):
            raise ApiError(400, "persistent must be a boolean")
        if ttl is not None:
            sb.ttl_seconds = ttl or None
        if persistent is not None:
            sb.persistent = persistent
        with manager.activity(sb):
            pass
        return JSONResponse(manager.lifecycle(sb))

    @app.post("/v1/sandboxes/{sandbox_id}/pause")
    async def pause(sandbox_id: str) -> Response:
        sb = manager.get(sandbox_id)
        if sb.status != "paused":
            await manager.pause(sb, True)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/resume")
    async def resume(sandbox_id: str) -> Response:
        sb = manager.get(sandbox_id)
        if sb.status == "paused":
            await manager.pause(sb, False)
        with manager.activity(sb):
            pass
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/logs")
    async def logs(sandbox_id: str) -> PlainTextResponse:
        sb = manager.get(sandbox_id)
        return PlainTextResponse("\n".join(sb.logs) + "\n")

    async def _fork(sandbox_id: str, request: Request, default_count: int) -> tuple[Sandbox, list[Sandbox]]:
        parent = manager.get(sandbox_id)
        body = await json_body(request, required=False)
        count = _int_field(body, "count", default_count) or default_count
        if parent.status != "running" or not parent.process.alive():
            raise ApiError(500, "parent sandbox not found or not running")
        with manager.activity(parent):
            children = await manager.fork(parent, count)
        return parent, children

    @app.post("/v1/sandboxes/{sandbox_id}/fork")
    async def fork(sandbox_id: str, request: Request) -> JSONResponse:
        parent, children = await _fork(sandbox_id, request, 1)
        return JSONResponse(
            {
                "parent_id": parent.id,
                "snapshot_id": f"snap-{uuid.uuid4()}",
                "children": [c.id for c in children],
                "at": rfc3339(time.time()),
            },
            status_code=201,
        )

    @app.post("/v1/sandboxes/{sandbox_id}/fork-tree")
    async def fork_tree(sandbox_id: str, request: Request) -> JSONResponse:
        parent, children = await _fork(sandbox_id, request, 2)
        return JSONResponse(
            {
                "tree_id": str(uuid.uuid4()),
                "parent_id": parent.id,
                "snapshot_id": f"snap-{uuid.uuid4()}",
                "children": [c.to_json() for c in children],
            },
            status_code=201,
        )

    return app

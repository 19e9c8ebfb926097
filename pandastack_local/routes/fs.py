"""Filesystem: read, write, list, stat and delete paths inside a sandbox (through its agent,
so every path and symlink resolves in the sandbox's own mount namespace)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .. import agent_client
from ..manager import ApiError, Sandbox, SandboxManager
from .deps import GuestPath, Manager, SandboxDep

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/fs")

MAX_BODY_BYTES = 32 * 1024 * 1024


def fs_error(exc: agent_client.AgentError, *, missing_status: int = 500) -> ApiError:
    if exc.errno == "ENOENT":
        return ApiError(missing_status, "file does not exist" if missing_status == 404 else str(exc))
    if exc.errno == "ENOSPC":
        return ApiError(507, str(exc))
    return ApiError(500, str(exc))


async def agent_fs(
    manager: SandboxManager, sb: Sandbox, call: Callable[[Path], Awaitable[Any]], *, missing_status: int = 500
) -> Any:
    """One file operation by the sandbox's agent: running check, activity, errors mapped."""
    manager.running(sb.id)
    with manager.activity(sb):
        try:
            return await call(sb.process.socket_path)
        except agent_client.AgentError as exc:
            raise fs_error(exc, missing_status=missing_status) from exc


@router.get("")
async def fs_read(manager: Manager, sb: SandboxDep, path: GuestPath) -> Response:
    data = await agent_fs(manager, sb, lambda sock: agent_client.read_file(sock, path))
    return Response(data, media_type="application/octet-stream")


@router.put("")
async def fs_write(request: Request, manager: Manager, sb: SandboxDep, path: GuestPath) -> JSONResponse:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(400, f"request body too large: max {MAX_BODY_BYTES} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(400, f"request body too large: max {MAX_BODY_BYTES} bytes")
    result = await agent_fs(manager, sb, lambda sock: agent_client.write_file(sock, path, bytes(body)))
    return JSONResponse({"path": path, "bytes": int(result.get("bytes", len(body)))})


@router.get("/dir")
async def fs_list(manager: Manager, sb: SandboxDep, path: GuestPath) -> JSONResponse:
    result = await agent_fs(manager, sb, lambda sock: agent_client.call(sock, {"op": "list", "path": path}))
    return JSONResponse({"path": path, "entries": result["entries"]})


@router.get("/stat")
async def fs_stat(manager: Manager, sb: SandboxDep, path: GuestPath) -> JSONResponse:
    result = await agent_fs(
        manager, sb, lambda sock: agent_client.call(sock, {"op": "stat", "path": path}), missing_status=404
    )
    return JSONResponse(result["entry"])


@router.delete("")
async def fs_delete(manager: Manager, sb: SandboxDep, path: GuestPath) -> Response:
    if path.rstrip("/") == "":
        raise ApiError(400, "refusing to delete /")
    await agent_fs(manager, sb, lambda sock: agent_client.call(sock, {"op": "delete", "path": path}))
    return Response(status_code=204)

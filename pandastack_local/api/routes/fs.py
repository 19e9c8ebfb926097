"""Filesystem: read, write, list, stat and delete paths inside a sandbox (through its agent,
so every path and symlink resolves in the sandbox's own mount namespace)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pandastack_local import agent_client
from pandastack_local.guest.agent import NOT_REGULAR, TOO_BIG
from pandastack_local.limits import FILE_READ_CAP_BYTES, MAX_FILE_BODY_BYTES
from pandastack_local.manager import ApiError, Sandbox, SandboxManager

from .deps import GuestDirPath, GuestPath, Manager, SandboxDep, read_body

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/fs")


def fs_error(exc: agent_client.AgentError, *, missing_status: int = 500) -> ApiError:
    if exc.errno == "ENOENT":
        return ApiError(missing_status, "file does not exist" if missing_status == 404 else str(exc))
    if exc.errno == "ENOSPC":
        return ApiError(507, str(exc))
    if exc.errno == "EBUSY":  # a mount point (gVisor's /tmp and /work): the path's fault
        return ApiError(409, f"{exc} (a mount point cannot be removed)")
    if exc.errno in (NOT_REGULAR, TOO_BIG):  # the file's fault (a FIFO, a device, over the cap)
        return ApiError(400, str(exc))
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
    data = await agent_fs(manager, sb, lambda sock: agent_client.read_file(sock, path, FILE_READ_CAP_BYTES))
    return Response(data, media_type="application/octet-stream")


@router.put("")
async def fs_write(request: Request, manager: Manager, sb: SandboxDep, path: GuestPath) -> JSONResponse:
    body = await read_body(request, MAX_FILE_BODY_BYTES)
    result = await agent_fs(manager, sb, lambda sock: agent_client.write_file(sock, path, body))
    return JSONResponse({"path": path, "bytes": int(result.get("bytes", len(body)))})


@router.get("/dir")
async def fs_list(manager: Manager, sb: SandboxDep, path: GuestDirPath) -> JSONResponse:
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
    if all(part in ("", ".") for part in path.split("/")):  # "/", "//", "/.", "/./"
        raise ApiError(400, f"path {path!r} is the sandbox's root: refusing to delete /")
    await agent_fs(manager, sb, lambda sock: agent_client.call(sock, {"op": "delete", "path": path}))
    return Response(status_code=204)

"""Filesystem: read, write, list, stat and delete paths inside a sandbox (through its agent,
so every path and symlink resolves in the sandbox's own mount namespace)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pandastack_local import agent_client
from pandastack_local.exceptions import PandaStackLocalError
from pandastack_local.guest.agent import IS_ROOT, NOT_REGULAR, TOO_BIG
from pandastack_local.limits import FILE_READ_CAP_BYTES, MAX_FILE_BODY_BYTES, STREAM_READ_AHEAD_BYTES
from pandastack_local.manager import ApiError, Sandbox, SandboxManager

from .deps import GuestDirPath, GuestPath, Manager, SandboxDep, read_body

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/fs")


# The OS refused the path (errno names from the agent): the client's request, not the server, is
# at fault, so a 4xx that names the path and the OS's reason. Missing paths keep the real server's
# 500 (404 for fs/stat): docs/local-server.md lists that difference.
FORBIDDEN = {"EACCES", "EPERM", "EROFS"}
CONFLICT = {"EEXIST", "ENOTEMPTY", "EBUSY", "ETXTBSY"}
NO_ROOM = {"ENOSPC", "EDQUOT"}
# The agent's own trouble (out of descriptors or memory), not the path's: still a 500.
AGENT_TROUBLE = {"EMFILE", "ENFILE", "ENOMEM", "EAGAIN", "EINTR", ""}


def fs_error(exc: agent_client.AgentError, *, missing_status: int = 500) -> ApiError:
    code = exc.errno
    if code == "ENOENT":
        return ApiError(missing_status, "file does not exist" if missing_status == 404 else str(exc))
    if code in NO_ROOM:
        return ApiError(507, str(exc))
    if code == "EBUSY":  # a mount point (gVisor's /tmp and /work): the path's fault
        return ApiError(409, f"{exc} (a mount point cannot be removed)")
    if code in CONFLICT:
        return ApiError(409, str(exc))
    if code in FORBIDDEN:
        return ApiError(403, str(exc))
    if code in (NOT_REGULAR, TOO_BIG, IS_ROOT):  # the file's fault (a FIFO, a device, over the cap, /)
        return ApiError(400, str(exc))
    if code in AGENT_TROUBLE:
        return ApiError(500, str(exc))
    return ApiError(400, str(exc))  # ENOTDIR, EISDIR, EIO, ELOOP, ENAMETOOLONG, EINVAL, ...


async def agent_fs(
    manager: SandboxManager,
    sb: Sandbox,
    call: Callable[[Path, agent_client.Watch], Awaitable[Any]],
    *,
    missing_status: int = 500,
) -> Any:
    """One file operation by the sandbox's agent: running check, activity, errors mapped."""
    manager.running(sb.id)
    with manager.activity(sb):
        try:
            return await call(sb.process.socket_path, manager.watch(sb))
        except agent_client.AgentError as exc:
            raise fs_error(exc, missing_status=missing_status) from exc
        except agent_client.AgentUnavailable as exc:
            raise await manager.agent_lost(sb, exc) from exc


def entry(raw: Any) -> dict[str, Any]:
    """One listing entry from the sandbox, as the server passes it on: the known fields of the
    known types (an agent's answer is guest-controlled data), names valid UTF-8."""
    if not isinstance(raw, dict):
        raise ApiError(500, "sandbox agent sent a listing entry that is not an object")

    def number(key: str) -> int:
        value = raw.get(key, 0)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    mode = raw.get("mode")
    return {
        "name": agent_client.clean_text(raw.get("name", "")),
        "is_dir": raw.get("is_dir") is True,
        "size": number("size"),
        "mode": mode if isinstance(mode, str) and len(mode) == 1 else "U",
        "mtime": number("mtime"),
    }


class TransferAborted(PandaStackLocalError):
    """A streamed answer that cannot end well (its sandbox failed mid-read): the connection is
    dropped rather than the body ended, so the client sees a broken transfer, not a short file."""


class FileStream(StreamingResponse):
    """A file's bytes as the agent sends them, at the client's pace; frees the read's reservation,
    activity and agent connection however it ends."""

    def __init__(self, body: AsyncIterator[bytes], release: contextlib.ExitStack) -> None:
        super().__init__(body, media_type="application/octet-stream")
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with self.release:
            with contextlib.suppress(TransferAborted):
                await super().__call__(scope, receive, send)


@router.get("")
async def fs_read(request: Request, manager: Manager, sb: SandboxDep, path: GuestPath) -> Response:
    """Streamed, not built whole: a client that reads nothing makes the server hold its
    reservation of the slow-reader budget (``limits.StreamBudget``), not the file."""
    manager.running(sb.id)
    with contextlib.ExitStack() as stack:
        stack.enter_context(request.app.state.stream_budget.hold("GET fs"))
        stack.enter_context(manager.activity(sb))
        try:
            conn, chunks = await agent_client.stream_file(
                sb.process.socket_path, path, FILE_READ_CAP_BYTES, STREAM_READ_AHEAD_BYTES, manager.watch(sb)
            )
        except agent_client.AgentUnavailable as exc:
            raise await manager.agent_lost(sb, exc) from exc
        stack.callback(conn.close)
        # The answer's status waits for the agent's first word: a refusal (missing, not a regular
        # file, over the cap) is a JSON error as before, never a 200 cut short.
        try:
            first = await anext(chunks, b"")
        except agent_client.AgentError as exc:
            raise fs_error(exc) from exc
        except agent_client.AgentUnavailable as exc:
            raise await manager.agent_lost(sb, exc) from exc
        release = stack.pop_all()

    async def body() -> AsyncIterator[bytes]:
        if first:
            yield first
        try:
            async for chunk in chunks:
                yield chunk
        except agent_client.AgentError as exc:
            sb.log(f"read {path}: the transfer was cut off: {exc}")
            raise TransferAborted from exc
        except agent_client.AgentUnavailable as exc:
            sb.log(f"read {path}: the transfer was cut off: {(await manager.agent_lost(sb, exc)).message}")
            raise TransferAborted from exc

    return FileStream(body(), release)


@router.put("")
async def fs_write(request: Request, manager: Manager, sb: SandboxDep, path: GuestPath) -> JSONResponse:
    """The body is held whole before the agent writes anything (a broken upload never touches the
    file), so it is held under the server-wide transfer budget (``limits.StreamBudget``): its bytes
    as they arrive, nothing before (a request that declares a size and sends nothing holds nothing)."""
    with request.app.state.stream_budget.hold("PUT fs", 0) as hold:
        body = await read_body(request, MAX_FILE_BODY_BYTES, hold.grow)
        result = await agent_fs(
            manager, sb, lambda sock, watch: agent_client.write_file(sock, path, body, watch)
        )
    return JSONResponse({"path": path, "bytes": int(result.get("bytes", len(body)))})


@router.get("/dir")
async def fs_list(manager: Manager, sb: SandboxDep, path: GuestDirPath) -> JSONResponse:
    entries = await agent_fs(
        manager, sb, lambda sock, watch: agent_client.list_dir(sock, path, FILE_READ_CAP_BYTES, watch)
    )
    return JSONResponse({"path": path, "entries": [entry(e) for e in entries]})


@router.get("/stat")
async def fs_stat(manager: Manager, sb: SandboxDep, path: GuestPath) -> JSONResponse:
    result = await agent_fs(
        manager,
        sb,
        lambda sock, watch: agent_client.call(sock, {"op": "stat", "path": path}, watch),
        missing_status=404,
    )
    return JSONResponse(entry(result.get("entry")))


@router.delete("")
async def fs_delete(manager: Manager, sb: SandboxDep, path: GuestPath) -> Response:
    if all(part in ("", ".") for part in path.split("/")):  # "/", "//", "/.", "/./"
        raise ApiError(400, f"path {path!r} is the sandbox's root: refusing to delete /")
    # The agent refuses every other spelling of the root, on the path as it resolves inside.
    await agent_fs(
        manager, sb, lambda sock, watch: agent_client.call(sock, {"op": "delete", "path": path}, watch)
    )
    return Response(status_code=204)

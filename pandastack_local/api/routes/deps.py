"""What every router shares: the error envelope, hand-parsed JSON bodies, and the
dependencies that resolve the manager, the addressed sandbox and the ``?path=`` argument."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from pandastack_local.limits import BODY_IDLE_SECONDS, MAX_JSON_BODY_BYTES
from pandastack_local.manager import ApiError, Sandbox, SandboxManager


def error(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body too large: the limit is {limit} bytes")


async def read_body(request: Request, limit: int, reserve: Callable[[int], None] | None = None) -> bytearray:
    """The request body, refused with 413 as soon as it is known to pass ``limit``: from
    Content-Length before anything is read, else while it streams in. ``reserve(n)``: called
    before ``n`` more bytes are held, as they arrive (never for a declared length: a client that
    declares a size and sends nothing holds nothing), so a budget can refuse them. A body that
    stalls for ``BODY_IDLE_SECONDS`` is a 408: a stalled upload holds what it sent no longer.
    Returned as the buffer it was read into (no copy: an upload is up to ``limit`` bytes)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(limit)
    body = bytearray()
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), BODY_IDLE_SECONDS)
        except StopAsyncIteration:
            return body
        except TimeoutError:
            raise ApiError(
                408, f"the request body stalled: no byte of it for {BODY_IDLE_SECONDS:g} s; send it whole"
            ) from None
        if len(body) + len(chunk) > limit:
            raise too_large(limit)
        if reserve is not None:
            reserve(len(chunk))
        body += chunk


async def json_body(request: Request, *, required: bool = True) -> dict[str, Any]:
    """Parse the body by hand, so malformed JSON is a clear 400 rather than FastAPI's 422."""
    raw = await read_body(request, MAX_JSON_BODY_BYTES)
    if not raw:  # no body at all; whitespace is not JSON (json.loads says so below)
        if required:
            raise ApiError(400, "invalid JSON body: empty")
        return {}
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}") from exc
    except RecursionError:
        raise ApiError(400, "invalid JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "invalid JSON body: expected an object")
    return data


def bool_field(body: dict[str, Any], key: str, default: bool = False) -> bool:
    """A JSON boolean if given (null is not one)."""
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"{key} must be a boolean (true or false), not {json.dumps(value)[:40]}")
    return value


def int_field(
    body: dict[str, Any],
    key: str,
    default: int | None = None,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int | None:
    if key not in body:
        return default
    value = body[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 1.0 is the integer 1 in JSON and in JSON Schema
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key} must be an integer, not {json.dumps(value)[:40]}")
    if minimum is not None and value < minimum:
        raise ApiError(400, f"{key} must not be negative" if minimum == 0 else f"{key} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ApiError(400, f"{key} must be at most {maximum}")
    return value


def check_text(value: str, field: str) -> str:
    """A client's string as the server can store, log and send back: valid Unicode. JSON lets a
    body carry a lone surrogate (``"x\\ud800"``), which has no UTF-8: refused here, with the
    field's name, before anything is made (not a 500 after the sandbox exists)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            400,
            f"{field} must be valid Unicode text: it holds a lone surrogate "
            f"(U+{ord(value[exc.start]):04X}) at character {exc.start}",
        ) from None
    return value


# Dependencies are async on purpose: sync ones would run in a worker thread, and the
# manager is only ever touched from the event-loop thread.
async def get_manager(request: Request) -> SandboxManager:
    manager: SandboxManager = request.app.state.manager
    return manager


Manager = Annotated[SandboxManager, Depends(get_manager)]


async def get_sandbox(sandbox_id: str, manager: Manager) -> Sandbox:
    """The sandbox named in the path, or 404."""
    return manager.get(sandbox_id)


SandboxDep = Annotated[Sandbox, Depends(get_sandbox)]


async def guest_path(request: Request) -> str:
    """Validate ``?path=``: absolute, no '..' component, no NUL. Resolution happens inside the sandbox."""
    path = request.query_params.get("path")
    if not path:
        raise ApiError(400, "path required: give ?path=/absolute/path")
    if "\x00" in path:
        raise ApiError(400, "path must not contain NUL bytes")
    if not path.startswith("/"):
        raise ApiError(400, f"path must be absolute (start with /): got {path[:200]!r}")
    if ".." in path.split("/"):
        raise ApiError(400, "path must not contain '..' components")
    return path


GuestPath = Annotated[str, Depends(guest_path)]


async def guest_dir_path(request: Request) -> str:
    """``fs/dir``'s path: none lists ``/``, as on the real server."""
    if not request.query_params.get("path"):
        return "/"
    return await guest_path(request)


GuestDirPath = Annotated[str, Depends(guest_dir_path)]

"""Code contexts: the SDK's ``create_code_context()`` / ``run_code()`` / ``close()`` on
``/v1/sandboxes/{id}/repl/sessions``, as the real server's agent answers them
(``agent/internal/api/repl_sessions.go``), with the rich results the SDK parses.

Each context is a long-lived Python process in the sandbox (``repl_kernel.py``), owned by the
sandbox's agent; this module validates requests, asks the agent, and checks every reply: it is
JSON read through a byte cap, parsed (never evaluated), and only the known fields of the known
types and sizes are passed on (``limits.py``: MAX_REPL_*).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pandastack_local import agent_client
from pandastack_local.limits import (
    MAX_CODE_CONTEXTS,
    MAX_REPL_OUTPUT_BYTES,
    MAX_REPL_PNG_BYTES,
    MAX_REPL_REPLY_BYTES,
    MAX_REPL_RESULTS,
    MAX_REPL_TEXT_RESULT_BYTES,
    REPL_DEFAULT_TIMEOUT_MS,
    REPL_KILL_GRACE_SECONDS,
    REPL_START_SECONDS,
)
from pandastack_local.manager import ApiError, Sandbox, SandboxManager, rfc3339

from .deps import Manager, SandboxDep, check_text, int_field, json_body
from .exec import CLIENT_CLOSED, client_gone, exec_slot

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/repl/sessions")

LANGUAGES = {"", "python", "py", "python3"}
MAX_TIMEOUT_MS = 24 * 3600 * 1000
CONTEXT_ID = re.compile(r"[0-9a-f]{32}")
CAPS = {
    "max_output_bytes": MAX_REPL_OUTPUT_BYTES,
    "max_results": MAX_REPL_RESULTS,
    "max_png_bytes": MAX_REPL_PNG_BYTES,
    "max_text_result_bytes": MAX_REPL_TEXT_RESULT_BYTES,
}
# What a result may carry, and how many characters of it (base64 grows a PNG by 4/3).
RESULT_TYPES = {
    "image/png": (MAX_REPL_PNG_BYTES * 4 + 2) // 3 + 4,
    "text/plain": MAX_REPL_TEXT_RESULT_BYTES,
    "text/html": MAX_REPL_TEXT_RESULT_BYTES,
}
# The kernel's own notes ("... more bytes dropped") come on top of a capped stream.
NOTE_ROOM = 512


# How long past its own wait (a run's timeout and kill grace, a start's) a request may take.
AGENT_SLACK_SECONDS = 15.0


async def agent_call(
    manager: SandboxManager,
    sb: Sandbox,
    request: dict[str, Any],
    seconds: float | None = agent_client.OP_SECONDS,
) -> dict[str, Any]:
    """One code-context request to the sandbox's agent; its refusals become JSON errors."""
    try:
        return await agent_client.call(sb.process.socket_path, request, manager.watch(sb), seconds)
    except agent_client.AgentError as exc:
        raise context_error(sb, request, exc) from exc
    except agent_client.AgentUnavailable as exc:
        raise await manager.agent_lost(sb, exc) from exc


def context_error(sb: Sandbox, request: dict[str, Any], exc: agent_client.AgentError) -> ApiError:
    cid = request.get("id", "")
    if exc.errno == "ENOENT":
        return not_found(sb, cid)
    if exc.errno == "EMLINK":
        return ApiError(429, f"{exc} (at most {MAX_CODE_CONTEXTS} per sandbox)", {"Retry-After": "1"})
    if exc.errno == "EBUSY":  # another run of the same context holds it
        return ApiError(409, f"code context {cid}: {exc}")
    if exc.errno == "ETIME":  # "timeout" in the message: the SDK raises SandboxTimeout, as for the real 500
        seconds = request["request"]["timeout_ms"] / 1000
        return ApiError(500, f"cell timeout after {seconds:g}s, and {exc}; create a new context")
    return ApiError(500, f"code context {cid}: {exc}")


def not_found(sb: Sandbox, cid: str) -> ApiError:
    return ApiError(404, f"code context {cid[:64]!r} not found in sandbox {sb.id}: closed, or never existed")


@router.post("")
async def create_context(request: Request, manager: Manager, sb: SandboxDep) -> JSONResponse:
    body = await json_body(request, required=False)
    language = body.get("language", "")
    if not isinstance(language, str):
        raise ApiError(400, "language must be a string (language=python)")
    if language.strip().lower() not in LANGUAGES:
        raise ApiError(400, f"language {language[:40]!r}: code contexts run python only (language=python)")
    manager.running(sb.id)
    cid = uuid.uuid4().hex
    with manager.activity(sb):
        await agent_call(
            manager,
            sb,
            {
                "op": "repl_open",
                "id": cid,
                "caps": CAPS,
                "max_contexts": MAX_CODE_CONTEXTS,
                "start_seconds": REPL_START_SECONDS,
            },
            REPL_START_SECONDS + AGENT_SLACK_SECONDS,
        )
    sb.log(f"code context {cid} opened")
    return JSONResponse(
        {"id": cid, "sandbox_id": sb.id, "language": "python", "created_at": rfc3339(time.time())},
        status_code=201,
    )


@router.get("")
async def list_contexts(manager: Manager, sb: SandboxDep) -> JSONResponse:
    manager.running(sb.id)
    listed = await agent_call(manager, sb, {"op": "repl_list"})
    out = [
        {"id": c["id"], "sandbox_id": sb.id, "language": "python", "created_at": rfc3339(c["created"])}
        | {"cells": c["cells"]}
        for c in listed.get("contexts", [])
    ]
    return JSONResponse(out)


@router.delete("/{context_id}")
async def close_context(context_id: str, manager: Manager, sb: SandboxDep) -> Response:
    if not CONTEXT_ID.fullmatch(context_id):
        raise not_found(sb, context_id)
    manager.running(sb.id)
    await agent_call(manager, sb, {"op": "repl_close", "id": context_id})
    sb.log(f"code context {context_id} closed")
    return Response(status_code=204)


@router.post("/{context_id}/run")
async def run_code(context_id: str, request: Request, manager: Manager, sb: SandboxDep) -> JSONResponse:
    body = await json_body(request)
    timeout_ms = int_field(body, "timeout_ms", 0, minimum=0) or REPL_DEFAULT_TIMEOUT_MS
    if timeout_ms > MAX_TIMEOUT_MS:
        raise ApiError(400, f"timeout_ms must be at most {MAX_TIMEOUT_MS} (one day)")
    code = body.get("code")
    if not isinstance(code, str) or not code:
        raise ApiError(400, 'code required: give the Python source to run as "code" (a non-empty string)')
    check_text(code, "code")
    if not CONTEXT_ID.fullmatch(context_id):
        raise not_found(sb, context_id)
    manager.running(sb.id)
    req = {
        "op": "repl_run",
        "id": context_id,
        "request": {"code": code, "timeout_ms": timeout_ms},
        "wait_seconds": timeout_ms / 1000 + REPL_KILL_GRACE_SECONDS,
        "max_reply_bytes": MAX_REPL_REPLY_BYTES,
    }
    started = time.monotonic()
    with exec_slot(sb), manager.activity(sb):
        reading = asyncio.ensure_future(read_reply(manager, sb, req))
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({reading, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not reading.done():  # closing the agent's connection interrupts the cell
                sb.log(f"code context {context_id}: client disconnected: run interrupted")
                return JSONResponse({"error": "client disconnected"}, status_code=CLIENT_CLOSED)
            raw = reading.result()
        finally:
            for task in (reading, gone):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
    reply = checked(raw)
    if reply.pop("timeout"):
        sb.log(f"code context {context_id}: cell timeout after {timeout_ms} ms")
        raise ApiError(
            500,
            f"cell timeout after {timeout_ms / 1000:g}s: the run was interrupted, the context kept its state",
        )
    reply["duration_ms"] = int((time.monotonic() - started) * 1000)
    return JSONResponse(reply)


async def read_reply(manager: SandboxManager, sb: Sandbox, req: dict[str, Any]) -> Any:
    """The kernel's reply line: at most MAX_REPL_REPLY_BYTES, parsed as JSON and nothing else."""
    seconds = req["wait_seconds"] + AGENT_SLACK_SECONDS
    try:
        conn = await agent_client.Connection.open(sb.process.socket_path, req, manager.watch(sb), seconds)
    except agent_client.AgentUnavailable as exc:
        raise await manager.agent_lost(sb, exc) from exc
    try:
        data = await conn.data(
            MAX_REPL_REPLY_BYTES,
            lambda: ApiError(500, f"code context {req['id']}: reply over {MAX_REPL_REPLY_BYTES} bytes"),
            lambda error: context_error(sb, req, error),
        )
    except agent_client.AgentUnavailable as exc:
        raise await manager.agent_lost(sb, exc) from exc
    finally:
        conn.close()
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise ApiError(500, f"code context {req['id']}: its reply is not JSON") from None


def text(value: Any, cap: int) -> str:
    """A string from the sandbox: a string, at most ``cap`` characters, valid UTF-8."""
    if not isinstance(value, str):
        return ""
    return value[:cap].encode("utf-8", "replace").decode("utf-8")


def checked(raw: Any) -> dict[str, Any]:
    """Only the fields the SDK reads, of their types and within their caps."""
    if not isinstance(raw, dict):
        raise ApiError(500, "code context: its reply is not a JSON object")
    stream_cap = MAX_REPL_OUTPUT_BYTES + NOTE_ROOM
    exit_code = raw.get("exit", 1)
    reply: dict[str, Any] = {
        "stdout": text(raw.get("stdout"), stream_cap),
        "stderr": text(raw.get("stderr"), stream_cap),
        "exit": exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else 1,
        "results": results(raw.get("results")),
        "error": text(raw.get("error"), stream_cap) or None,
        "timeout": raw.get("timeout") is True,
    }
    exc = raw.get("exception")
    if isinstance(exc, dict) and reply["error"]:
        reply["exception"] = {k: text(exc.get(k), stream_cap) for k in ("name", "value", "traceback")}
    return reply


def results(raw: Any) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for item in raw if isinstance(raw, list) else []:
        if len(out) >= MAX_REPL_RESULTS or not isinstance(item, dict):
            break
        if "type" in item:  # the wire shape {"type": mime, "data": ...}
            mime = item.get("type")
            if isinstance(mime, str) and mime in RESULT_TYPES and isinstance(item.get("data"), str):
                out.append({"type": mime, "data": text(item["data"], RESULT_TYPES[mime])})
        else:  # a MIME bundle
            bundle = {m: text(v, RESULT_TYPES[m]) for m, v in item.items() if m in RESULT_TYPES}
            if bundle:
                out.append(bundle)
    return out

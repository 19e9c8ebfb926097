"""Exec: run a command in a sandbox, answered whole (JSON) or streamed (SSE)."""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .. import agent_client
from ..agent import JSON, STDERR, STDOUT
from ..manager import ApiError, Sandbox, SandboxManager
from .deps import Manager, SandboxDep, int_field, json_body

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}")

MAX_EXEC_OUTPUT = 16 * 1024 * 1024
LOG_OUTPUT_BYTES = 4096


async def exec_request(request: Request, manager: SandboxManager, sb: Sandbox) -> dict[str, Any]:
    """Validate an exec body and check the sandbox runs; returns the agent request."""
    body = await json_body(request)
    cmd = body.get("cmd")
    if not isinstance(cmd, str) or not cmd.strip():
        raise ApiError(400, "cmd required")
    timeout = int_field(body, "timeout_seconds", 0) or 0
    if timeout < 0:
        raise ApiError(400, "timeout_seconds must not be negative")
    manager.running(sb.id)
    sb.log(f"$ {cmd}")
    return {"op": "exec", "cmd": cmd, "timeout_seconds": timeout}


@router.post("/exec")
async def exec_cmd(request: Request, manager: Manager, sb: SandboxDep) -> JSONResponse:
    req = await exec_request(request, manager, sb)
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


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


@router.post("/exec/stream")
async def exec_stream(request: Request, manager: Manager, sb: SandboxDep) -> StreamingResponse:
    req = await exec_request(request, manager, sb)
    conn = await agent_client.Connection.open(sb.process.socket_path, req)

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

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

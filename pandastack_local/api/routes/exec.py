"""Exec: run a command in a sandbox, answered whole (JSON) or streamed (SSE).

Both forms hold one of the sandbox's exec slots (``limits.exec_slots``) and end the
command when their client goes away, so neither a burst of requests nor an
abandoned one can exhaust the agent or keep the sandbox busy past its TTL.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pandastack_local import agent_client
from pandastack_local.guest.agent import JSON, STDERR, STDOUT
from pandastack_local.limits import (
    EXEC_RETRY_AFTER,
    LOG_COMMAND_CHARS,
    LOG_OUTPUT_CHARS,
    MAX_COMMAND_BYTES,
    MAX_EXEC_OUTPUT_BYTES,
    MAX_EXEC_TIMEOUT_SECONDS,
    STREAM_READ_AHEAD_BYTES,
    exec_slots,
)
from pandastack_local.manager import ApiError, Sandbox, SandboxManager

from .deps import Manager, SandboxDep, check_text, int_field, json_body

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}")

# A client that closed its connection: nobody reads the answer (nginx's name for it).
CLIENT_CLOSED = 499


def loggable(cmd: str) -> str:
    """What the sandbox log keeps of a command: its start, and how much was left out."""
    if len(cmd) <= LOG_COMMAND_CHARS:
        return cmd
    return f"{cmd[:LOG_COMMAND_CHARS]}... [{len(cmd) - LOG_COMMAND_CHARS} more characters not logged]"


async def exec_request(request: Request, manager: SandboxManager, sb: Sandbox) -> dict[str, Any]:
    """Validate an exec body and check the sandbox runs; returns the agent request."""
    body = await json_body(request)
    cmd = body.get("cmd")
    if not isinstance(cmd, str) or not cmd:  # whitespace runs, as on the real server (exit 0)
        raise ApiError(400, "cmd required")
    check_command(cmd, "cmd")
    timeout = int_field(body, "timeout_seconds", 0, minimum=0, maximum=MAX_EXEC_TIMEOUT_SECONDS) or 0
    manager.running(sb.id)
    sb.log(f"$ {loggable(cmd)}")
    return {"op": "exec", "cmd": cmd, "timeout_seconds": timeout}


def exec_seconds(timeout: int) -> float | None:
    """An exec's deadline at the server: its timeout plus slack (the agent kills the tree at the
    timeout and answers); none without a timeout (it ends with its client, or its agent)."""
    return timeout + agent_client.EXEC_SLACK_SECONDS if timeout > 0 else None


def check_command(cmd: str, field: str) -> None:
    """Refuse what no shell could be given: NUL bytes, a lone surrogate (no UTF-8 for it), or one
    argument past the kernel's limit."""
    if "\x00" in cmd:
        raise ApiError(400, f"{field} must not contain NUL bytes")
    check_text(cmd, field)
    size = len(cmd.encode("utf-8"))
    if size >= MAX_COMMAND_BYTES:
        raise ApiError(
            400,
            f"{field} is {size} bytes; it must be under {MAX_COMMAND_BYTES} bytes (the kernel's limit for "
            "one argument): write long scripts to a file with PUT fs and run that",
        )


@contextlib.contextmanager
def exec_slot(sb: Sandbox) -> Iterator[None]:
    """Hold one of the sandbox's exec slots, or refuse with 429 and Retry-After."""
    limit = exec_slots(sb.template)
    if sb.active_execs >= limit:
        raise ApiError(
            429,
            f"too many concurrent execs: sandbox {sb.id} already runs {limit}, the most its template "
            f"(nofile={sb.template.nofile}) allows; retry when one ends",
            {"Retry-After": EXEC_RETRY_AFTER},
        )
    sb.active_execs += 1
    try:
        yield
    finally:
        sb.active_execs -= 1


class CappedOutput:
    """The first ``MAX_EXEC_OUTPUT_BYTES`` of one stream, and a count of the bytes dropped."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = MAX_EXEC_OUTPUT_BYTES - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.dropped += max(len(chunk) - room, 0)

    def text(self) -> str:
        text = self.data.decode("utf-8", "replace")
        if self.dropped:
            text += (
                f"\n[pandastack-local: {self.dropped} more bytes of {self.name} dropped: a non-stream "
                f"exec keeps the first {MAX_EXEC_OUTPUT_BYTES} bytes of each stream; use exec/stream "
                "for all of it]\n"
            )
        return text


async def read_exec(conn: agent_client.Connection, out: dict[int, CappedOutput]) -> dict[str, Any]:
    """Collect an exec's capped output; return its final frame."""
    final: dict[str, Any] = {}
    async for kind, payload in conn.frames():
        if kind in out:
            out[kind].add(payload)
        elif kind == JSON:
            final = payload
    return final


async def client_gone(request: Request) -> None:
    """Return when the client disconnects (the body is already read: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post("/exec")
async def exec_cmd(request: Request, manager: Manager, sb: SandboxDep) -> Response:
    req = await exec_request(request, manager, sb)
    started = time.monotonic()
    ran = await run_capped(request, manager, sb, req)
    if ran is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(
        {
            "stdout": ran.stdout,
            "stderr": ran.stderr,
            "exit_code": ran.exit_code,
            "duration_ms": int((time.monotonic() - started) * 1000),
            "truncated": bool(ran.stdout_dropped or ran.stderr_dropped),
            "stdout_dropped_bytes": ran.stdout_dropped,
            "stderr_dropped_bytes": ran.stderr_dropped,
        }
    )


@dataclass(frozen=True)
class ExecResult:
    """One finished exec: its exit code and each stream's text (decoded once) and dropped bytes."""

    exit_code: int
    stdout: str
    stderr: str
    stdout_dropped: int
    stderr_dropped: int


async def run_capped(
    request: Request, manager: SandboxManager, sb: Sandbox, req: dict[str, Any]
) -> ExecResult | None:
    """Run one agent exec to its end with capped output, or None when the client went away
    first (closing the connection makes the agent kill the process tree)."""
    out = {STDOUT: CappedOutput("stdout"), STDERR: CappedOutput("stderr")}
    with exec_slot(sb), manager.activity(sb):
        try:
            conn = await agent_client.Connection.open(
                sb.process.socket_path, req, manager.watch(sb), exec_seconds(req["timeout_seconds"])
            )
        except agent_client.AgentUnavailable as exc:
            raise await manager.agent_lost(sb, exc) from exc
        reading = asyncio.ensure_future(read_exec(conn, out))
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({reading, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not reading.done():
                sb.log("client disconnected: exec ended")
                return None
            final = reading.result()
        except agent_client.AgentUnavailable as exc:
            raise await manager.agent_lost(sb, exc) from exc
        finally:
            for task in (reading, gone):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            conn.close()
    stdout, stderr = out[STDOUT].text(), out[STDERR].text()
    if stdout or stderr:
        sb.log((stdout + stderr)[:LOG_OUTPUT_CHARS])
    if "error" in final:
        message = agent_client.clean_text(final["error"])
        sb.log(f"error: {message}")
        raise ApiError(500, message)
    sb.log(f"exit {final.get('exit_code')}")
    code = int(final.get("exit_code", -1))
    return ExecResult(code, stdout, stderr, out[STDOUT].dropped, out[STDERR].dropped)


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class ExecStream(StreamingResponse):
    """An SSE response that frees the exec's slot and connection however it ends: finished,
    client gone (Starlette cancels the body), or never started."""

    def __init__(self, body: AsyncIterator[str], release: contextlib.ExitStack) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with self.release:
            await super().__call__(scope, receive, send)


@router.post("/exec/stream")
async def exec_stream(request: Request, manager: Manager, sb: SandboxDep) -> StreamingResponse:
    req = await exec_request(request, manager, sb)
    with contextlib.ExitStack() as stack:
        stack.enter_context(exec_slot(sb))
        stack.enter_context(request.app.state.stream_budget.hold())  # limits.StreamBudget
        try:
            conn = await agent_client.Connection.open(
                sb.process.socket_path,
                req,
                manager.watch(sb),
                exec_seconds(req["timeout_seconds"]),
                STREAM_READ_AHEAD_BYTES,
            )
        except agent_client.AgentUnavailable as exc:
            raise await manager.agent_lost(sb, exc) from exc
        stack.callback(conn.close)
        release = stack.pop_all()

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
                            message = agent_client.clean_text(payload["error"])
                            sb.log(f"error: {message}")
                            yield sse("error", {"error": message})
                        else:
                            sb.log(f"exit {payload.get('exit_code')}")
                            yield sse("exit", {"exit_code": int(payload.get("exit_code", -1))})
            except agent_client.AgentUnavailable as exc:
                yield sse("error", {"error": (await manager.agent_lost(sb, exc)).message})
            finally:
                conn.close()

    return ExecStream(events(), release)

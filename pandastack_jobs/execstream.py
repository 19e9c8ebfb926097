"""The job's exec stream, read without keeping it: every chunk goes to the callbacks and is gone.

``Sandbox.exec_stream`` of the SDK (0.10) also appends every chunk to lists of its own (for the
partial output of ``ExecInterrupted``), so a job that prints gigabytes grows the orchestrator's
memory by as much, whatever the core's ``OutputTail`` keeps. This is the same request over the
SDK's own transport (``Client._request``: its session, auth, URL and error mapping) and the same
event handling, with the stream read in bounded pieces: one SSE line of at most
:data:`MAX_EVENT_BYTES`, and only a tail of each stream kept for ``ExecInterrupted``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pandastack
from pandastack import Sandbox

from .spec import TAIL_BYTES

Chunk = Callable[[str], None]

READ_BYTES = 64 * 1024
# One event line: the server sends at most 64 KiB of output per event, JSON-escaped (up to 6x).
MAX_EVENT_BYTES = 1024 * 1024


def exec_stream(
    sb: Sandbox,
    cmd: str,
    *,
    on_stdout: Chunk | None = None,
    on_stderr: Chunk | None = None,
    timeout_seconds: int | None = None,
) -> int:
    """Run ``cmd`` as ``sb.exec_stream`` does (same request, events, errors and read timeout) and
    return its exit code; the memory it holds is bounded however much the command prints."""
    client = sb._client
    body: dict[str, Any] = {"cmd": cmd}
    if timeout_seconds is not None:
        body["timeout_seconds"] = timeout_seconds
    response = client._request(
        "POST",
        f"/sandboxes/{sb.id}/exec/stream",
        json=body,
        headers={"Accept": "text/event-stream"},
        stream=True,
        raw_response=True,
        timeout=max(client.timeout, float(timeout_seconds or 0), 900.0),  # as the SDK waits
    )
    exit_code: int | None = None
    tails = {"stdout": "", "stderr": ""}
    callbacks = {"stdout": on_stdout, "stderr": on_stderr}
    try:
        event = ""
        for raw in _lines(response):
            line = raw.strip()
            if line.startswith("event:"):
                event = line[len("event:") :].strip()
                continue
            if not line.startswith("data:"):
                continue
            payload = line[len("data:") :].lstrip()
            try:
                parsed = json.loads(payload)
            except ValueError:
                parsed = {"chunk": payload}
            if not isinstance(parsed, dict):
                parsed = {"chunk": payload}
            if event in callbacks:
                chunk = str(parsed.get("chunk", ""))
                tails[event] = (tails[event] + chunk)[-TAIL_BYTES:]
                callback = callbacks[event]
                if callback is not None:
                    callback(chunk)
            elif event == "exit":
                exit_code = int(parsed.get("exit_code", 0))
            elif event == "error":
                err = str(parsed.get("error", "exec stream error"))
                if "timeout" in err.lower():
                    raise pandastack.SandboxTimeout(err)
                raise pandastack.ServerError(err)
    finally:
        response.close()
    if exit_code is None:
        raise pandastack.ExecInterrupted(
            "exec stream ended without an exit code: the sandbox's host became unavailable "
            "mid-command (agent restart, reaped sandbox, or lost connection); the command's "
            "outcome is unknown",
            partial_stdout=tails["stdout"],
            partial_stderr=tails["stderr"],
        )
    return exit_code


def _lines(response: Any) -> Iterator[str]:
    """The response's lines, read ``READ_BYTES`` at a time; a line over ``MAX_EVENT_BYTES`` is a
    broken stream (requests' ``iter_lines`` would buffer it whole)."""
    pending = b""
    for piece in response.iter_content(chunk_size=READ_BYTES):
        if not piece:
            continue
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace")
        if len(pending) > MAX_EVENT_BYTES:
            raise pandastack.ServerError(
                f"exec stream sent a line over {MAX_EVENT_BYTES} bytes: not an event stream"
            )
    if pending:
        yield pending.decode("utf-8", "replace")

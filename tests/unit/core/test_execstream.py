"""pandastack_jobs.execstream: the exec stream's events read as the SDK reads them, holding only
bounded pieces (the real-server proof of the memory bound is
tests/security/test_bounds_orchestrator.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pandastack
import pytest

from pandastack_jobs import execstream
from pandastack_jobs.spec import TAIL_BYTES


class _Response:
    """A streamed answer: the given bytes, in the given pieces."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.closed = False

    def iter_content(self, chunk_size: int = 1) -> Iterator[bytes]:
        yield from self.pieces

    def close(self) -> None:
        self.closed = True


class _Client:
    timeout = 30.0

    def __init__(self, response: _Response) -> None:
        self.response = response
        self.calls: list[dict[str, Any]] = []

    def _request(self, method: str, path: str, **kw: Any) -> _Response:
        self.calls.append({"method": method, "path": path, **kw})
        return self.response


def _sandbox(pieces: list[bytes]) -> tuple[pandastack.Sandbox, _Client]:
    client = _Client(_Response(pieces))
    return pandastack.Sandbox.from_dict({"id": "sb-1"}, client=client), client  # type: ignore[arg-type]


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def test_events_split_anywhere_reach_the_callbacks_and_the_exit_code_is_returned() -> None:
    wire = (
        _event("stdout", {"chunk": "héllo\n"})
        + _event("stderr", {"chunk": "e"})
        + _event("exit", {"exit_code": 4})
    )
    sb, client = _sandbox([wire[i : i + 3] for i in range(0, len(wire), 3)])  # UTF-8 split mid-character
    out: list[str] = []
    err: list[str] = []
    code = execstream.exec_stream(sb, "job", on_stdout=out.append, on_stderr=err.append, timeout_seconds=120)
    assert (code, "".join(out), err) == (4, "héllo\n", ["e"])
    call = client.calls[0]
    assert call["path"] == "/sandboxes/sb-1/exec/stream" and call["json"] == {
        "cmd": "job",
        "timeout_seconds": 120,
    }
    assert call["stream"] and call["raw_response"] and call["timeout"] == 900.0  # the SDK's read timeout
    assert client.response.closed


def test_a_stream_without_an_exit_raises_exec_interrupted_with_only_a_tail() -> None:
    sb, _ = _sandbox([_event("stdout", {"chunk": "y" * 100_000}), _event("stdout", {"chunk": "end"})])
    with pytest.raises(pandastack.ExecInterrupted) as info:
        execstream.exec_stream(sb, "job")
    assert info.value.partial_stdout == ("y" * 100_000 + "end")[-TAIL_BYTES:]


def test_error_events_are_the_sdks_errors() -> None:
    sb, _ = _sandbox([_event("error", {"error": "exec timeout"})])
    with pytest.raises(pandastack.SandboxTimeout):
        execstream.exec_stream(sb, "job")
    sb, _ = _sandbox([_event("error", {"error": "agent lost"})])
    with pytest.raises(pandastack.ServerError, match="agent lost"):
        execstream.exec_stream(sb, "job")


def test_a_line_that_never_ends_is_refused_at_the_cap_not_buffered() -> None:
    endless = (b"x" * execstream.READ_BYTES for _ in range(10_000))  # 640 MiB, never a newline
    sb, client = _sandbox(endless)  # type: ignore[arg-type]
    with pytest.raises(pandastack.ServerError, match="over 1048576 bytes"):
        execstream.exec_stream(sb, "job")
    assert client.response.closed

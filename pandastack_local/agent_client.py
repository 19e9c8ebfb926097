"""The server's side of the agent protocol (asyncio, one connection per operation).

Every wait on an agent has a deadline. Connecting, each frame read and each write wait at most
``AGENT_SILENCE_SECONDS`` for the agent to show life: it sends a heartbeat frame (``BEAT``)
every ``HEARTBEAT_SECONDS`` on every connection it is handling, so an agent that answers nothing
for that long (stopped with ``kill -STOP``, hung, or not there) is *lost* (``AgentLost``), not
slow. A request also has a deadline of its own (``seconds``: an exec's is its timeout plus
``EXEC_SLACK_SECONDS``); past it the request ends (``AgentDeadline``) whatever the agent says.
A ``Watch`` tells a connection whose sandbox it serves: each frame is a sign of life for the TTL,
and silence while the sandbox is paused (frozen on purpose) is waited out.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pandastack_local.exceptions import PandaStackLocalError
from pandastack_local.guest.agent import (
    _HEADER,
    BEAT,
    CHUNK,
    DATA,
    END,
    JSON,
    MAX_FRAME,
    MAX_READ_BYTES,
    TAR_OVERHEAD_BYTES,
    TOO_BIG,
    pack,
    pack_json,
)

QUIESCE_CLOSE_SECONDS = 5.0
# No frame (not even a heartbeat, sent every HEARTBEAT_SECONDS) for this long: the agent is lost.
AGENT_SILENCE_SECONDS = 10.0
# The whole of one request, at most: a file operation or a listing; a fork's disk copy.
OP_SECONDS = 120.0
COPY_SECONDS = 600.0
# A streamed file read (GET fs) as a whole: it moves at its client's pace, holding a fixed reservation.
TRANSFER_SECONDS = 600.0
# An exec with a timeout ends at most this long after it (the agent kills the tree at the timeout).
EXEC_SLACK_SECONDS = 15.0
# A timed-out frame read looks once more this briefly: the bytes may be there already if the
# event loop itself was held up past the deadline.
LATE_LOOK_SECONDS = 0.2


def _never() -> bool:
    return False


def _nothing() -> None:
    return None


@dataclass
class Watch:
    """What a connection reports to, and asks of, the sandbox it serves."""

    # Each frame from the agent (its heartbeat included): the sandbox is alive and in use.
    alive: Callable[[], None] = _nothing
    # True while silence is expected (the sandbox is paused): the silence deadline waits.
    hold: Callable[[], bool] = _never
    silence: float = AGENT_SILENCE_SECONDS


def clean_text(value: Any) -> str:
    """A string from a sandbox as the server can log it and send it back: valid UTF-8 (a lone
    surrogate becomes ``?``)."""
    text = value if isinstance(value, str) else str(value)
    return text.encode("utf-8", "replace").decode("utf-8")


class AgentUnavailable(PandaStackLocalError):
    """The sandbox's agent cannot be reached: the sandbox is gone or dying."""


class AgentLost(AgentUnavailable):
    """The agent stopped answering: no frame, not even its heartbeat, within its silence deadline."""

    def __init__(self, message: str, watch: Watch) -> None:
        super().__init__(message)
        self.watch = watch  # whose agent (a fork's copy talks to two)


class AgentDeadline(AgentUnavailable):
    """The request's own deadline passed (the agent may still be alive): the request ends."""


class AgentError(PandaStackLocalError):
    """The agent answered with an error (e.g. a failed file operation)."""

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(clean_text(reply.get("error", "agent error")))
        self.reply = reply

    @property
    def errno(self) -> str:
        return clean_text(self.reply.get("errno", ""))


def lost(watch: Watch) -> AgentLost:
    return AgentLost(
        f"sandbox agent is not answering: no reply, not even its heartbeat, for {watch.silence:g}s "
        "(stopped or hung); the sandbox is lost",
        watch,
    )


class Connection:
    """One request/reply exchange with an agent, every wait under a deadline (module docstring)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        watch: Watch,
        deadline: float | None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.watch = watch
        self.deadline = deadline  # time.monotonic() past which the request ends, or None
        # The largest frame taken from the agent: a stream of known frames asks for less (``stream_file``).
        self.max_frame = MAX_FRAME

    @classmethod
    async def open(
        cls,
        socket_path: Path,
        request: dict[str, Any],
        watch: Watch | None = None,
        seconds: float | None = OP_SECONDS,
        limit: int = MAX_FRAME * 2,
    ) -> Connection:
        """Connect and send ``request``; ``seconds``: the request's own deadline (None: none,
        e.g. an exec without a timeout, which ends with its client); ``limit``: how far ahead of the
        caller the reader buffers (at most about twice it)."""
        watch = watch or Watch()
        deadline = None if seconds is None else time.monotonic() + seconds
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(socket_path), limit=limit), watch.silence
            )
        except asyncio.TimeoutError:
            raise lost(watch) from None
        except OSError as exc:
            raise AgentUnavailable("sandbox agent is not reachable: the sandbox is not running") from exc
        conn = cls(reader, writer, watch, deadline)
        try:
            writer.write(pack_json(request))
            await conn.drain()
        except BaseException:
            conn.close()
            raise
        return conn

    def _left(self) -> float:
        """Seconds until the next wait must end: the silence deadline or the request's own."""
        wait = self.watch.silence
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise AgentDeadline(
                    "sandbox agent request timeout: the request passed its deadline and was ended"
                )
            wait = min(wait, left)
        return wait

    async def _wait(self, make: Callable[[], Any]) -> Any:
        """Await ``make()`` under the deadlines; silence while the sandbox is held is waited out."""
        while True:
            wait = self._left()
            try:
                return await asyncio.wait_for(make(), wait)
            except asyncio.TimeoutError:
                pass
            try:  # the event loop may have been held up past the deadline with the bytes there
                return await asyncio.wait_for(make(), LATE_LOOK_SECONDS)
            except asyncio.TimeoutError:
                pass
            if self.watch.hold():
                continue
            self._left()  # the request's own deadline first: that is why the wait ended
            raise lost(self.watch)

    async def drain(self) -> None:
        try:
            await self._wait(self.writer.drain)
        except ConnectionError as exc:
            raise AgentUnavailable("sandbox agent went away mid-request") from exc

    async def send_data(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        for i in range(0, len(view), CHUNK):
            self.writer.write(pack(DATA, bytes(view[i : i + CHUNK])))
            await self.drain()

    async def send_end(self) -> None:
        self.writer.write(pack(END, b""))
        await self.drain()

    async def _frame(self) -> tuple[int, bytes]:
        try:
            header = await self._wait(lambda: self.reader.readexactly(_HEADER.size))
            kind, length = _HEADER.unpack(header)
            if length > self.max_frame:
                raise AgentUnavailable("sandbox agent sent an oversized frame")
            payload = await self._wait(lambda: self.reader.readexactly(length)) if length else b""
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise AgentUnavailable("sandbox agent went away mid-request: the sandbox is not running") from exc
        self.watch.alive()
        return kind, payload

    async def frame(self) -> tuple[int, bytes]:
        """The next frame that is not a heartbeat."""
        while True:
            kind, payload = await self._frame()
            if kind != BEAT:
                return kind, payload

    async def frames(self) -> AsyncIterator[tuple[int, Any]]:
        """Yield (kind, payload) until the final JSON frame, which is yielded decoded."""
        while True:
            kind, payload = await self.frame()
            if kind == JSON:
                yield kind, decoded(payload, dict, "a reply", "a JSON object")
                return
            yield kind, payload

    async def data(
        self,
        max_bytes: int,
        over: Callable[[], Exception],
        failed: Callable[[AgentError], Exception] = lambda e: e,
    ) -> bytes:
        """The answer's DATA frames joined, counted here whatever answers: past ``max_bytes`` the
        exception ``over()`` is raised, and an error reply raises ``failed(its AgentError)``."""
        data = bytearray()
        async for kind, payload in self.frames():
            if kind == DATA:
                data += payload
                if len(data) > max_bytes:
                    raise over()
            elif kind == JSON and "error" in payload:
                raise failed(AgentError(payload))
        return bytes(data)

    async def result(self) -> dict[str, Any]:
        async for kind, payload in self.frames():
            if kind == JSON:
                if "error" in payload:
                    raise AgentError(payload)
                return dict(payload)
        raise AgentUnavailable("sandbox agent closed the connection")

    def close(self) -> None:
        self.writer.close()


async def call(
    socket_path: Path, request: dict[str, Any], watch: Watch | None = None, seconds: float | None = OP_SECONDS
) -> dict[str, Any]:
    conn = await Connection.open(socket_path, request, watch, seconds)
    try:
        return await conn.result()
    finally:
        conn.close()


def decoded(data: bytes, kind: type, what: str, kind_name: str) -> Any:
    """``data`` parsed as JSON of type ``kind``: what the agent sends is checked like any input."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        raise AgentUnavailable(f"sandbox agent sent {what} that is not JSON") from None
    if not isinstance(value, kind):
        raise AgentUnavailable(f"sandbox agent sent {what} that is not {kind_name}")
    return value


def over_cap(message: str) -> AgentError:
    return AgentError({"error": message, "errno": TOO_BIG})


async def read_file(
    socket_path: Path, path: str, max_bytes: int = MAX_READ_BYTES, watch: Watch | None = None
) -> bytes:
    """A whole regular file, at most ``max_bytes``: the agent refuses more, and the count here
    holds even if what answers on the socket does not."""
    conn = await Connection.open(socket_path, {"op": "read", "path": path, "max_bytes": max_bytes}, watch)
    try:
        return await conn.data(
            max_bytes, lambda: over_cap(f"read {path}: file is over the {max_bytes}-byte read cap")
        )
    finally:
        conn.close()


async def stream_file(
    socket_path: Path, path: str, max_bytes: int, read_ahead: int, watch: Watch | None = None
) -> tuple[Connection, AsyncIterator[bytes]]:
    """A regular file's bytes as they come, for a client that may read slowly: the connection (its
    caller closes it) and an iterator of its chunks. The agent opens the file inside the sandbox;
    here at most about twice ``read_ahead`` bytes and one frame are buffered (a frame of more than a
    few chunks is refused), and past ``max_bytes`` the iterator raises the over-cap error."""
    conn = await Connection.open(
        socket_path, {"op": "read", "path": path, "max_bytes": max_bytes}, watch, TRANSFER_SECONDS, read_ahead
    )
    # The agent sends CHUNK-sized data; an error reply naming a long non-ASCII path (JSON-escaped,
    # twice) can be a few times that.
    conn.max_frame = 4 * CHUNK

    async def chunks() -> AsyncIterator[bytes]:
        sent = 0
        async for kind, payload in conn.frames():
            if kind == DATA:
                sent += len(payload)
                if sent > max_bytes:
                    raise over_cap(f"read {path}: file is over the {max_bytes}-byte read cap")
                yield payload
            elif kind == JSON and "error" in payload:
                raise AgentError(payload)

    return conn, chunks()


async def list_dir(
    socket_path: Path, path: str, max_bytes: int = MAX_READ_BYTES, watch: Watch | None = None
) -> list[Any]:
    """A directory's entries (parsed JSON, for the caller to check), at most ``max_bytes`` of
    listing: the agent refuses more, and the count here holds whatever answers."""
    conn = await Connection.open(socket_path, {"op": "list", "path": path, "max_bytes": max_bytes}, watch)
    try:
        data = await conn.data(
            max_bytes, lambda: over_cap(f"list {path}: the listing is over the {max_bytes}-byte cap")
        )
    finally:
        conn.close()
    return decoded(data, list, "a listing", "a list")


async def write_file(
    socket_path: Path, path: str, data: bytes | bytearray, watch: Watch | None = None
) -> dict[str, Any]:
    conn = await Connection.open(socket_path, {"op": "write", "path": path}, watch)
    try:
        await conn.send_data(data)
        await conn.send_end()
        return await conn.result()
    except ConnectionError as exc:
        raise AgentUnavailable("sandbox agent went away mid-request") from exc
    finally:
        conn.close()


async def copy_disk(
    src_socket: Path,
    dst_socket: Path,
    max_bytes: int,
    src_watch: Watch | None = None,
    dst_watch: Watch | None = None,
) -> None:
    """Fork's disk copy: a tar stream out of the parent's agent, into the child's, of at most
    ``max_bytes`` of file data (the parent's agent checks first; the count here holds anyway)."""
    src = await Connection.open(
        src_socket, {"op": "tar_out", "max_bytes": max_bytes}, src_watch, COPY_SECONDS
    )
    try:
        dst = await Connection.open(dst_socket, {"op": "tar_in"}, dst_watch, COPY_SECONDS)
    except BaseException:
        src.close()
        raise
    streamed = 0
    try:
        async for kind, payload in src.frames():
            if kind == DATA:
                streamed += len(payload)
                if streamed > max_bytes + TAR_OVERHEAD_BYTES:
                    raise over_cap(f"fork refused: the copy passed the {max_bytes}-byte fork copy cap")
                dst.writer.write(pack(DATA, payload))
                await dst.drain()
            elif kind == END:
                await dst.send_end()
            elif kind == JSON and "error" in payload:
                raise AgentError(payload)
        await dst.result()
    finally:
        src.close()
        dst.close()


async def quiesce(socket_path: Path, watch: Watch | None = None) -> None:
    """Ask the agent to give up its listener (a checkpoint must hold no host socket), then wait
    until it has closed this last connection too."""
    conn = await Connection.open(socket_path, {"op": "quiesce"}, watch)
    try:
        await conn.result()
        await asyncio.wait_for(conn.reader.read(), QUIESCE_CLOSE_SECONDS)
    except asyncio.TimeoutError:
        raise AgentUnavailable("sandbox agent did not close its connection for the checkpoint") from None
    finally:
        conn.close()

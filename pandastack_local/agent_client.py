"""The server's side of the agent protocol (asyncio, one connection per operation)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pandastack_local.guest.agent import (
    _HEADER,
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


class AgentUnavailable(Exception):
    """The sandbox's agent cannot be reached: the sandbox is gone or dying."""


class AgentError(Exception):
    """The agent answered with an error (e.g. a failed file operation)."""

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(str(reply.get("error", "agent error")))
        self.reply = reply

    @property
    def errno(self) -> str:
        return str(self.reply.get("errno", ""))


class Connection:
    """One request/reply exchange with an agent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, socket_path: Path, request: dict[str, Any], limit: int = MAX_FRAME * 2) -> Connection:
        """``limit``: how far ahead of the caller the reader buffers (at most about twice it)."""
        try:
            reader, writer = await asyncio.open_unix_connection(str(socket_path), limit=limit)
            writer.write(pack_json(request))
            await writer.drain()
        except OSError as exc:
            raise AgentUnavailable("sandbox agent is not reachable: the sandbox is not running") from exc
        return cls(reader, writer)

    async def send_data(self, data: bytes) -> None:
        view = memoryview(data)
        for i in range(0, len(view), CHUNK):
            self.writer.write(pack(DATA, bytes(view[i : i + CHUNK])))
            await self.writer.drain()

    async def send_end(self) -> None:
        self.writer.write(pack(END, b""))
        await self.writer.drain()

    async def frame(self) -> tuple[int, bytes]:
        try:
            header = await self.reader.readexactly(_HEADER.size)
            kind, length = _HEADER.unpack(header)
            if length > MAX_FRAME:
                raise AgentUnavailable("sandbox agent sent an oversized frame")
            return kind, await self.reader.readexactly(length) if length else b""
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise AgentUnavailable("sandbox agent went away mid-request: the sandbox is not running") from exc

    async def frames(self) -> AsyncIterator[tuple[int, Any]]:
        """Yield (kind, payload) until the final JSON frame, which is yielded decoded."""
        while True:
            kind, payload = await self.frame()
            if kind == JSON:
                yield kind, json.loads(payload)
                return
            yield kind, payload

    async def result(self) -> dict[str, Any]:
        async for kind, payload in self.frames():
            if kind == JSON:
                if "error" in payload:
                    raise AgentError(payload)
                return dict(payload)
        raise AgentUnavailable("sandbox agent closed the connection")

    def close(self) -> None:
        self.writer.close()


async def call(socket_path: Path, request: dict[str, Any]) -> dict[str, Any]:
    conn = await Connection.open(socket_path, request)
    try:
        return await conn.result()
    finally:
        conn.close()


def over_cap(message: str) -> AgentError:
    return AgentError({"error": message, "errno": TOO_BIG})


async def read_file(socket_path: Path, path: str, max_bytes: int = MAX_READ_BYTES) -> bytes:
    """A whole regular file, at most ``max_bytes``: the agent refuses more, and the count here
    holds even if what answers on the socket does not."""
    conn = await Connection.open(socket_path, {"op": "read", "path": path, "max_bytes": max_bytes})
    chunks: list[bytes] = []
    received = 0
    try:
        async for kind, payload in conn.frames():
            if kind == DATA:
                received += len(payload)
                if received > max_bytes:
                    raise over_cap(f"read {path}: file is over the {max_bytes}-byte read cap")
                chunks.append(payload)
            elif kind == JSON and "error" in payload:
                raise AgentError(payload)
    finally:
        conn.close()
    return b"".join(chunks)


async def write_file(socket_path: Path, path: str, data: bytes) -> dict[str, Any]:
    conn = await Connection.open(socket_path, {"op": "write", "path": path})
    try:
        await conn.send_data(data)
        await conn.send_end()
        return await conn.result()
    except ConnectionError as exc:
        raise AgentUnavailable("sandbox agent went away mid-request") from exc
    finally:
        conn.close()


async def copy_disk(src_socket: Path, dst_socket: Path, max_bytes: int) -> None:
    """Fork's disk copy: a tar stream out of the parent's agent, into the child's, of at most
    ``max_bytes`` of file data (the parent's agent checks first; the count here holds anyway)."""
    src = await Connection.open(src_socket, {"op": "tar_out", "max_bytes": max_bytes})
    dst = await Connection.open(dst_socket, {"op": "tar_in"})
    streamed = 0
    try:
        async for kind, payload in src.frames():
            if kind == DATA:
                streamed += len(payload)
                if streamed > max_bytes + TAR_OVERHEAD_BYTES:
                    raise over_cap(f"fork refused: the copy passed the {max_bytes}-byte fork copy cap")
                dst.writer.write(pack(DATA, payload))
                await dst.writer.drain()
            elif kind == END:
                await dst.send_end()
            elif kind == JSON and "error" in payload:
                raise AgentError(payload)
        await dst.result()
    finally:
        src.close()
        dst.close()


async def quiesce(socket_path: Path) -> None:
    """Ask the agent to give up its listener (a checkpoint must hold no host socket), then wait
    until it has closed this last connection too."""
    conn = await Connection.open(socket_path, {"op": "quiesce"})
    try:
        await conn.result()
        await asyncio.wait_for(conn.reader.read(), QUIESCE_CLOSE_SECONDS)
    except asyncio.TimeoutError:
        raise AgentUnavailable("sandbox agent did not close its connection for the checkpoint") from None
    finally:
        conn.close()

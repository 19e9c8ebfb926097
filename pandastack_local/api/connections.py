"""What the HTTP server owes its clients when some are hostile: uvicorn's protocol, guarded.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but has no header-read
timeout, no cap on connections per client address or in total, and asyncio logs every failed
``accept()`` with a traceback (CPython 3.11 does it up to ``backlog`` times per loop tick). So a
client that opens connections and never finishes its headers could lock every other client out
and grow the log by hundreds of MB. ``guarded_protocol`` wraps whichever protocol class uvicorn
would use (httptools or h11) with:

- connection caps, per client address and in total: a connection past either is answered at
  once with a JSON 429 (that address) or 503 (the server), ``Retry-After``, and closed after a
  short linger (so the client reads the answer rather than a reset);
- a header timeout: a request's headers must be complete within ``header_timeout`` of the
  connection's start or of the request's first byte (408, then closed), and within
  ``limits.MAX_HEADER_BYTES`` (431);
- a write-stall timeout: a connection whose unsent output does not drain for
  ``limits.WRITE_STALL_SECONDS`` is dropped (its buffered bytes freed);
- JSON for uvicorn's own 400 (a request that does not parse).

``RepeatFilter`` keeps the log small: a repeated message is printed once per minute, with the
count of the ones left out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pandastack_local.limits import (
    MAX_HEADER_BYTES,
    MAX_LINGERING_CONNECTIONS,
    REFUSE_LINGER_SECONDS,
    WRITE_STALL_SECONDS,
)

log = logging.getLogger(__name__)


@dataclass
class ConnectionGuard:
    """The server-wide connection counts and caps (one per server)."""

    max_total: int
    max_per_client: int
    header_timeout: float
    open: int = 0
    by_client: dict[str, int] = field(default_factory=dict)
    lingering: int = 0
    refused_per_client: int = 0  # for /metrics (pandastack_local/metrics.py)
    refused_total: int = 0

    def admit(self, client: str) -> tuple[int, str] | None:
        """None (and the connection counted), or the (status, message) to refuse it with."""
        if self.by_client.get(client, 0) >= self.max_per_client:
            self.refused_per_client += 1
            return 429, (
                f"too many connections from {client}: at most {self.max_per_client} at once per client "
                "address; close idle ones or retry later"
            )
        if self.open >= self.max_total:
            self.refused_total += 1
            return 503, f"too many connections: the server holds {self.max_total}, its limit; retry later"
        self.open += 1
        self.by_client[client] = self.by_client.get(client, 0) + 1
        return None

    def release(self, client: str) -> None:
        self.open -= 1
        left = self.by_client.get(client, 1) - 1
        if left > 0:
            self.by_client[client] = left
        else:
            self.by_client.pop(client, None)


def response_bytes(status: int, message: str, retry_after: bool = False) -> bytes:
    """A whole HTTP/1.1 response with the API's error envelope, for answers given outside the app."""
    from http import HTTPStatus

    body = json.dumps({"error": message}).encode()
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after:
        head.append("retry-after: 1")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def guarded_protocol(base: type[asyncio.Protocol], guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """``base`` (uvicorn's HttpToolsProtocol or H11Protocol) with ``guard``'s caps and timeouts."""
    loop_time = time.monotonic

    class Guarded(base):  # type: ignore[valid-type,misc]
        _refused = False
        _lingering = False
        _counted = False
        _client = ""
        _header_timer: asyncio.TimerHandle | None = None
        _stall_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0
        _header_started = 0.0

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            peer = transport.get_extra_info("peername")
            self._client = str(peer[0]) if isinstance(peer, tuple) and peer else "local"
            refusal = guard.admit(self._client)
            if refusal is not None:
                self._refuse(transport, *refusal)
                return
            self._counted = True
            super().connection_made(transport)
            self._arm_header_timer()

        def _refuse(self, transport: Any, status: int, message: str) -> None:
            self._refused = True
            self._refused_transport = transport
            transport.write(response_bytes(status, message, retry_after=True))
            if guard.lingering >= MAX_LINGERING_CONNECTIONS:
                transport.close()
                return
            # Read (and drop) what the client sends for a moment: closing with its request unread
            # would answer it with a reset, which can discard the refusal before it is read.
            guard.lingering += 1
            self._lingering = True
            asyncio.get_running_loop().call_later(REFUSE_LINGER_SECONDS, transport.close)

        def _waiting_for_headers(self) -> bool:
            """No request under way: none yet, or the last one answered and its body all read
            (bytes after an early answer, a 413 say, are that request's body, not new headers)."""
            cycle = getattr(self, "cycle", None)
            return cycle is None or (bool(cycle.response_complete) and not cycle.more_body)

        def _arm_header_timer(self) -> None:
            self._header_bytes = 0
            self._header_started = loop_time()
            self._header_timer = asyncio.get_running_loop().call_later(
                guard.header_timeout, self._header_timeout
            )

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self._answer_and_close(
                    408, f"request headers not received within {guard.header_timeout:g} s: closing"
                )

        def _answer_and_close(self, status: int, message: str) -> None:
            self.transport.write(response_bytes(status, message))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            waiting = self._waiting_for_headers()
            if waiting and self._header_timer is None:
                self._arm_header_timer()  # the first byte of the next request on a kept-alive connection
            before = getattr(self, "cycle", None)
            super().data_received(data)
            if not waiting:
                return
            if getattr(self, "cycle", None) is not before:  # its headers are complete
                self._disarm_header_timer()
                return
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                self._disarm_header_timer()
                self._answer_and_close(431, f"request headers over {MAX_HEADER_BYTES} bytes")

        def eof_received(self) -> bool | None:
            if self._refused:
                self._refused_transport.close()
                return None
            return super().eof_received()  # type: ignore[no-any-return]

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                if getattr(self, "_lingering", False):
                    self._lingering = False
                    guard.lingering -= 1
                return
            if self._counted:
                self._counted = False
                guard.release(self._client)
            self._disarm_header_timer()
            if self._stall_timer is not None:
                self._stall_timer.cancel()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall_timer is None:
                self._stall_timer = asyncio.get_running_loop().call_later(WRITE_STALL_SECONDS, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

        def _stalled(self) -> None:
            """The client read nothing of its answer for WRITE_STALL_SECONDS: drop it (and what
            the server had buffered for it)."""
            self._stall_timer = None
            self.transport.abort()

        def send_400_response(self, msg: str) -> None:
            self._answer_and_close(400, f"invalid HTTP request: {msg}")

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


class RepeatFilter(logging.Filter):
    """Print a message at most once per ``window`` seconds (by logger, level and first line); the
    next one printed says how many were left out. A flood costs a line a minute, not a line each."""

    def __init__(self, window: float = 60.0) -> None:
        super().__init__()
        self.window = window
        self.seen: dict[tuple[str, int, str], list[float]] = {}  # key -> [window start, left out]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg).split("\n", 1)[0][:200])
        now = time.monotonic()
        entry = self.seen.get(key)
        if entry is not None and now - entry[0] < self.window:
            entry[1] += 1
            return False
        if len(self.seen) > 1000:
            self.seen.clear()
        left_out = int(entry[1]) if entry is not None else 0
        self.seen[key] = [now, 0]
        if left_out:
            record.msg = f"{record.msg} [{left_out} more like this in the last {self.window:g} s left out]"
        return True

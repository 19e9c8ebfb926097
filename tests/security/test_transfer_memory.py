"""What file transfers can make the server hold (red-team finding, issue 34's follow-up): eight unread
``GET fs`` answers of 32 MiB each raised the server's RSS from 56 MB to 350 MB, each answer built
whole in memory and then left in the write buffer of a client that reads nothing.

A read now streams from the agent (which opens the file inside the sandbox: the host never follows a
guest path) in 64 KiB frames, with back-pressure from the client's socket, and each transfer holds
a reservation of the server-wide budget for slow readers (``--stream-buffer-mb``, shared with
``exec/stream``); past it a JSON 503 with ``Retry-After``. An upload is held whole (nothing touches
the file until all of it has arrived) and so reserves its size of the same budget.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from pandastack_local import LocalServer

from .bounds_support import MiB, RssWatch

FILE_BYTES = 32 * MiB  # the read cap (limits.FILE_READ_CAP_BYTES): the largest file GET fs answers
READERS = 8


def _request(port: int, head: str, key: str, extra: str = "") -> socket.socket:
    """A socket that sent one request's headers (and nothing of a body): the caller decides the rest."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # a small window: the server keeps the rest
    s.sendall(f"{head} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n{extra}\r\n".encode())
    return s


def _status(s: socket.socket, deadline: float) -> int:
    """The status of the answer on ``s`` (its first line only; the rest stays unread)."""
    s.settimeout(max(deadline - time.monotonic(), 0.1))
    line = b""
    while not line.endswith(b"\r\n"):
        byte = s.recv(1)
        assert byte, f"the server closed the connection before answering ({line!r})"
        line += byte
    return int(line.split()[1])


def _answer(s: socket.socket, deadline: float) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of a short answer on ``s``."""
    status = _status(s, deadline)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = s.recv(4096)
        assert chunk, body
        body += chunk
    return status, json.loads(body)


@contextlib.contextmanager
def _server(budget_mb: int) -> Iterator[tuple[LocalServer, httpx.Client, str]]:
    """A private server with ``--stream-buffer-mb budget_mb`` and one base sandbox."""
    with LocalServer(pool_size=0, extra_args=("--stream-buffer-mb", str(budget_mb))) as server:
        auth = {"Authorization": f"Bearer {server.api_key}"}
        with httpx.Client(base_url=server.url, headers=auth, timeout=60) as http:
            sid = http.post("/v1/sandboxes", json={"template": "base"}).json()["id"]
            try:
                yield server, http, sid
            finally:
                http.delete(f"/v1/sandboxes/{sid}")


def _exec(http: httpx.Client, sid: str, cmd: str) -> dict[str, Any]:
    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout_seconds": 60})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert body["exit_code"] == 0, body
    return body


def test_unread_file_reads_hold_a_bounded_reservation_each_and_the_total_is_capped() -> None:
    """Eight clients ask for a 32 MiB file and read nothing of it. Seen failing on the old code: the
    server's RSS grew by 290 MiB (each answer whole in its write buffer), and a ninth read was
    served as well. Now each holds about 1 MiB (the 8 MiB budget is spent: the ninth is a JSON 503
    with Retry-After naming the flag), the RSS stays within the budget plus noise, and once they go
    a read streams the whole file back, byte for byte. An upload larger than the whole budget is a
    413 naming the flag (it could never fit)."""
    with _server(budget_mb=READERS) as (server, http, sid):
        _exec(http, sid, f"head -c {FILE_BYTES} /dev/urandom > /work/big")
        digest = _exec(http, sid, "sha256sum /work/big")["stdout"].split()[0]
        assert server.pid is not None
        stuck: list[socket.socket] = []
        try:
            with RssWatch(server.pid) as watch:
                for _ in range(READERS):
                    stuck.append(
                        _request(server.port, f"GET /v1/sandboxes/{sid}/fs?path=/work/big", server.api_key)
                    )
                deadline = time.monotonic() + 30
                assert [_status(s, deadline) for s in stuck] == [200] * READERS
                # Every answer has started; the old code had each whole file in memory by now. Watch
                # for a while: a streamed one fills what it may hold and stops there.
                end = time.monotonic() + 3
                while time.monotonic() < end:
                    assert server.running()
                    time.sleep(0.1)
            watch.check()
            assert watch.growth < READERS * MiB + 24 * MiB, f"server RSS grew by {watch.growth / MiB:.0f} MiB"
            r = http.get(f"/v1/sandboxes/{sid}/fs", params={"path": "/work/big"})
            assert r.status_code == 503, (r.status_code, r.headers, r.content[:200])
            assert r.headers["retry-after"] == "1"
            assert "GET fs" in r.json()["error"] and "--stream-buffer-mb" in r.json()["error"], r.text
        finally:
            for s in stuck:
                s.close()
        deadline = time.monotonic() + 15  # the closed readers give their reservations back
        while True:
            r = http.get(f"/v1/sandboxes/{sid}/fs", params={"path": "/work/big"})
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text[:200]
        assert len(r.content) == FILE_BYTES and hashlib.sha256(r.content).hexdigest() == digest
        # The errors a read had before it streamed are still answered before anything is sent.
        r = http.get(f"/v1/sandboxes/{sid}/fs", params={"path": "/work/missing"})
        assert r.status_code == 500 and "missing" in r.json()["error"], r.text
        _exec(http, sid, f"head -c {FILE_BYTES + 1} /dev/zero > /work/over")
        r = http.get(f"/v1/sandboxes/{sid}/fs", params={"path": "/work/over"})
        assert r.status_code == 400 and "read cap" in r.json()["error"], r.text
        # An upload larger than the whole budget could never fit: 413, naming the flag.
        r = http.put(
            f"/v1/sandboxes/{sid}/fs", params={"path": "/work/huge"}, content=b"x" * (READERS + 1) * MiB
        )
        assert r.status_code == 413 and "--stream-buffer-mb" in r.json()["error"], r.text


def _upload(port: int, sid: str, key: str, size: int, sent: threading.Event) -> socket.socket:
    """An upload of ``size`` bytes that sends all of its body but the last byte, from a thread."""
    s = _request(port, f"PUT /v1/sandboxes/{sid}/fs?path=/work/up", key, f"Content-Length: {size}\r\n")

    def send() -> None:
        with contextlib.suppress(OSError):  # refused at once: the server stops reading
            s.sendall(b"\0" * (size - 1))
        sent.set()

    threading.Thread(target=send, daemon=True).start()
    return s


def test_unfinished_uploads_are_held_within_the_budget() -> None:
    """Eight uploads of 32 MiB that never send their last byte. Seen failing on the old code: the
    server took in all eight bodies and answered none (each held whole, waiting for its last byte:
    the test timed out waiting for a refusal). Now an upload reserves its size of the budget
    (40 MiB: one fits), the others are a JSON 503 with Retry-After before their body is read, a
    small one still fits beside it, and once the broken upload goes a full-size one goes through."""
    with _server(budget_mb=40) as (server, http, sid):
        assert server.pid is not None
        stuck: list[socket.socket] = []
        events = [threading.Event() for _ in range(READERS)]
        try:
            with RssWatch(server.pid) as watch:
                stuck.append(_upload(server.port, sid, server.api_key, FILE_BYTES, events[0]))
                assert events[0].wait(30), "the first upload's body was not taken"
                for event in events[1:]:
                    stuck.append(_upload(server.port, sid, server.api_key, FILE_BYTES, event))
                deadline = time.monotonic() + 30
                answers = [_answer(s, deadline) for s in stuck[1:]]
                assert [status for status, _ in answers] == [503] * (READERS - 1), answers
                error = answers[0][1]["error"]
                assert "PUT fs" in error and "--stream-buffer-mb" in error, error
                # What is left of the budget still takes a small upload: a budget, not a lock.
                r = http.put(f"/v1/sandboxes/{sid}/fs", params={"path": "/work/small"}, content=b"x" * 1000)
                assert r.status_code == 200, r.text
            watch.check()
            assert watch.growth < 40 * MiB + 24 * MiB, f"server RSS grew by {watch.growth / MiB:.0f} MiB"
        finally:
            for s in stuck:
                s.close()
        deadline = time.monotonic() + 15  # the broken upload gives its reservation back
        while True:
            r = http.put(f"/v1/sandboxes/{sid}/fs", params={"path": "/work/up"}, content=b"y" * FILE_BYTES)
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200 and r.json()["bytes"] == FILE_BYTES, r.text


def test_uploads_that_declare_a_size_and_send_nothing_hold_no_budget() -> None:
    """The red team's lock-out: PUT fs requests that declare 31 MiB and never send a byte of it.
    Seen failing before: the declared size was reserved at once, so two such sockets (of a 40 MiB
    budget) made every tenant's transfers a 503 for as long as they stayed open. Now a body holds
    the budget only as its bytes arrive, so a full-size upload goes through beside them."""
    with _server(budget_mb=40) as (_server_, http, sid):
        idle = [
            _request(
                _server_.port,
                f"PUT /v1/sandboxes/{sid}/fs?path=/work/idle",
                _server_.api_key,
                f"Content-Length: {31 * MiB}\r\n",
            )
            for _ in range(READERS)
        ]
        try:
            time.sleep(1)  # the server has read every request's headers
            r = http.put(f"/v1/sandboxes/{sid}/fs", params={"path": "/work/up"}, content=b"y" * FILE_BYTES)
            assert r.status_code == 200 and r.json()["bytes"] == FILE_BYTES, r.text
        finally:
            for s in idle:
                s.close()

"""Issue 12, item 6: the API cannot be made to hoard memory or run forever, and small bad
inputs get an immediate JSON 400 that names the field.

Each test talks to a real server over HTTP (httpx for the raw wire, the SDK where it is
what users call). Memory is read from /proc/<server pid>/status (bounds_support.RssWatch,
whose watchdog stops a private server that regresses before the host suffers).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pandastack_local import LocalServer
from pandastack_local.limits import (
    LOG_COMMAND_CHARS,
    MAX_COMMAND_BYTES,
    MAX_EXEC_OUTPUT_BYTES,
    MAX_JSON_BODY_BYTES,
    exec_slots,
)
from pandastack_local.templates.registry import Template
from pandastack_local.testing.procs import pids_matching

from ..support.server import GVISOR
from .bounds_support import MiB, RssWatch, client_fixture, http_fixture, server_fixture  # noqa: F401


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """A private server with a 128-file template, started under umask 0 (the permissions test
    needs that; the old umask is restored at once)."""
    tdir = tmp_path_factory.mktemp("templates") / "small"
    tdir.mkdir()
    (tdir / "template.json").write_text(json.dumps({"name": "small", "nofile": 128, "pids_max": 128}))
    old = os.umask(0)
    try:
        srv = LocalServer(template_dirs=[str(tdir)], pool_size=0).start()
    finally:
        os.umask(old)
    try:
        yield srv
    finally:
        srv.close()


def procs(sb: Any) -> str:
    """The command lines of every process in the sandbox."""
    return str(sb.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout)


def test_non_stream_exec_output_is_capped_and_says_so(
    server: LocalServer, client: Any, http: httpx.Client
) -> None:
    sb = client.sandboxes.create(template="base")
    big = 32 * MiB
    cmd = f"head -c {big} /dev/zero | tr '\\0' a; head -c {big} /dev/zero | tr '\\0' b >&2"
    assert server.pid is not None
    with RssWatch(server.pid) as watch:
        r = http.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": cmd}, timeout=60)
    watch.check()
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    assert body["exit_code"] == 0
    assert body["truncated"] is True
    assert body["stdout_dropped_bytes"] == big - MAX_EXEC_OUTPUT_BYTES
    assert body["stderr_dropped_bytes"] == big - MAX_EXEC_OUTPUT_BYTES
    assert body["stdout"].startswith("a" * MAX_EXEC_OUTPUT_BYTES)
    assert f"{big - MAX_EXEC_OUTPUT_BYTES} more bytes of stdout dropped" in body["stdout"]
    assert "use exec/stream" in body["stderr"]
    # Under the cap nothing changes, and the response says so too.
    small = http.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": "echo hi"}).json()
    assert (small["stdout"], small["truncated"], small["stdout_dropped_bytes"]) == ("hi\n", False, 0)


def test_request_bodies_are_capped_with_a_json_413(
    server: LocalServer, client: Any, http: httpx.Client
) -> None:
    sb = client.sandboxes.create(template="base")
    padded = json.dumps({"cmd": "true", "pad": "x" * (MAX_JSON_BODY_BYTES + 1)}).encode()
    for method, path in [("POST", "exec"), ("POST", "exec/stream"), ("PATCH", "lifecycle"), ("POST", "fork")]:
        r = http.request(method, f"/v1/sandboxes/{sb.id}/{path}", content=padded)
        assert r.status_code == 413, (path, r.status_code)
        assert "too large" in r.json()["error"]
    r = http.post("/v1/sandboxes", content=padded)
    assert r.status_code == 413 and "too large" in r.json()["error"]
    assert [s.id for s in client.sandboxes.list()] == [sb.id]

    # A big body with no Content-Length (chunked) is cut off while it streams in: memory stays flat.
    def chunks() -> Iterator[bytes]:
        yield b'{"cmd": "true", "pad": "'
        for _ in range(256):
            yield b"x" * (256 * 1024)  # 64 MiB in all

    assert server.pid is not None
    with RssWatch(server.pid) as watch:
        try:
            r = http.post(f"/v1/sandboxes/{sb.id}/exec", content=chunks())
            status = r.status_code
        except httpx.HTTPError:  # the server may answer 413 and close before the upload ends
            status = 413
    watch.check()
    assert status == 413
    assert sb.exec("echo alive").stdout == "alive\n"


def test_what_is_logged_of_a_command_is_capped(client: Any) -> None:
    sb = client.sandboxes.create(template="base")
    long_cmd = ": " + "x" * (100 * 1024)
    assert sb.exec(long_cmd).exit_code == 0
    logged = [line for line in sb.logs() if ": xxx" in line]
    assert len(logged) == 1
    assert len(logged[0]) < LOG_COMMAND_CHARS + 200
    assert "more characters not logged" in logged[0]


def test_oversized_or_nul_command_is_an_immediate_400(client: Any, http: httpx.Client) -> None:
    sb = client.sandboxes.create(template="base")
    for cmd in ("echo " + "x" * MAX_COMMAND_BYTES, "echo a\x00b"):
        for route in ("exec", "exec/stream"):
            started = time.monotonic()
            r = http.post(f"/v1/sandboxes/{sb.id}/{route}", json={"cmd": cmd})
            assert time.monotonic() - started < 1.0
            assert r.status_code == 400, (route, r.status_code, r.text[:200])
            assert "cmd" in r.json()["error"]
    # One byte under the limit still runs (the agent's prefix included, it fits the kernel's).
    ok = "true " + "x" * (MAX_COMMAND_BYTES - 6)
    assert len(ok) == MAX_COMMAND_BYTES - 1
    assert http.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": ok}).json()["exit_code"] == 0


def _wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.parametrize("route", ["exec", "exec/stream"])
def test_an_exec_whose_client_disconnected_ends(server: LocalServer, client: Any, route: str) -> None:
    """A silent exec with no timeout: when its client goes away the command is killed and the
    sandbox counts as idle again (so its TTL can fire)."""
    sb = client.sandboxes.create(template="base")
    marker = f"sleep 4{len(route)}1"
    body = json.dumps({"cmd": marker}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(
            f"POST /v1/sandboxes/{sb.id}/{route} HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert _wait_for(lambda: marker in procs(sb), 5), "the exec never started"
        assert sb.lifecycle()["idle_seconds"] == 0
    assert _wait_for(lambda: marker not in procs(sb), 5), "the exec outlived its client"
    time.sleep(1.2)
    assert sb.lifecycle()["idle_seconds"] >= 1, "the sandbox still counts as busy"


def test_forking_a_parent_with_a_1tib_sparse_file_is_refused_fast(client: Any, http: httpx.Client) -> None:
    parent = client.sandboxes.create(template="base")
    parent.exec("truncate -s 1T /work/huge")
    started = time.monotonic()
    r = http.post(f"/v1/sandboxes/{parent.id}/fork", json={"count": 1}, timeout=15)
    assert time.monotonic() - started < 5
    if GVISOR:
        # gVisor's fork is a memory checkpoint: a sparse file's holes are no pages, so it is fast
        # and small, and the child has the same sparse file.
        assert r.status_code == 201, (r.status_code, r.text[:300])
        (child_id,) = r.json()["children"]
        assert client.sandboxes.get(child_id).exec("stat -c %s /work/huge").stdout == f"{1 << 40}\n"
        client.sandboxes.delete(child_id)
        assert [s.id for s in client.sandboxes.list()] == [parent.id]
        parent.kill()
        return
    assert r.status_code == 409, (r.status_code, r.text[:300])
    message = r.json()["error"]
    assert "fork copy cap" in message and "/work/huge" in message
    assert [s.id for s in client.sandboxes.list()] == [parent.id]  # no half-made child left
    # The same parent forks once the file is gone.
    parent.exec("rm /work/huge && echo kept > /work/kept")
    child = parent.fork()
    assert child.filesystem.read("/work/kept") == b"kept\n"


def test_excess_concurrent_execs_get_429_and_the_agent_survives(small_server: LocalServer) -> None:
    """60 at once on a 128-file template used to kill its agent (out of descriptors)."""
    c = small_server.client()
    sb = c.sandboxes.create(template="small")
    slots = exec_slots(Template("small", nofile=128))
    url = f"/v1/sandboxes/{sb.id}/exec"
    results: list[httpx.Response] = []
    lock = threading.Lock()
    auth = {"Authorization": f"Bearer {small_server.api_key}"}
    pool = httpx.Limits(max_connections=100)
    http = httpx.Client(base_url=small_server.url, headers=auth, timeout=60, limits=pool)

    def run(cmd: str) -> None:
        r = http.post(url, json={"cmd": cmd})
        with lock:
            results.append(r)

    def burst(n: int, cmd: str) -> list[threading.Thread]:
        threads = [threading.Thread(target=run, args=(cmd,)) for _ in range(n)]
        for t in threads:
            t.start()
        return threads

    def hold(gate: str) -> str:
        """A command that runs until ``gate`` exists (made with PUT fs, which needs no exec slot)."""
        return f"mktemp /tmp/held.XXXXXX >/dev/null; until [ -e {gate} ]; do sleep 0.1; done"

    def release(gate: str) -> None:
        assert http.put(f"/v1/sandboxes/{sb.id}/fs", params={"path": gate}, content=b"").status_code == 200

    # Gates named for this run alone: test-nonroot counts the same commands on the host beside it.
    go1, go2 = f"/tmp/go1-{os.getpid()}", f"/tmp/go2-{os.getpid()}"
    # Every slot busy (seen on the host), then one more: refused at once, with a wait hint.
    held = burst(slots, hold(go1))
    if GVISOR:  # the jobs' processes live in the sentry: count their marker files (no exec slot)
        assert _wait_for(
            lambda: sum(f.name.startswith("held.") for f in sb.filesystem.listdir("/tmp")) == slots, 20
        )
    else:
        assert _wait_for(lambda: len(pids_matching(hold(go1))) == slots, 20)
    started = time.monotonic()
    r = http.post(url, json={"cmd": "true"})
    assert time.monotonic() - started < 1.0
    assert r.status_code == 429 and r.headers.get("retry-after") == "1", (r.status_code, r.text)
    assert "too many concurrent execs" in r.json()["error"]
    release(go1)
    for t in held:
        t.join()
    assert [x.status_code for x in results] == [200] * slots

    # The burst that used to kill the agent: exactly the slots run, the rest are refused, no 5xx.
    results.clear()
    threads = burst(60, hold(go2))
    assert _wait_for(lambda: len(results) == 60 - slots, 20), sorted(x.status_code for x in results)
    if not GVISOR:  # (gVisor's guest processes are not host processes: the statuses below count)
        assert len(pids_matching(hold(go2))) == slots
    release(go2)
    for t in threads:
        t.join()
    statuses = sorted(x.status_code for x in results)
    assert statuses == [200] * slots + [429] * (60 - slots), statuses
    assert sb.exec("echo alive").stdout == "alive\n"
    http.close()
    c.sandboxes.delete(sb.id)


def test_small_bad_inputs_are_immediate_json_400s_naming_the_field(client: Any, http: httpx.Client) -> None:
    sb = client.sandboxes.create(template="base")
    sb.exec("mkdir -p /work && echo keep > /work/keep")
    base = f"/v1/sandboxes/{sb.id}"
    cases: list[tuple[str, str, dict[str, Any], str]] = [
        ("GET", f"{base}/fs", {"params": {"path": "work/x"}}, "path"),
        ("GET", f"{base}/fs/stat", {"params": {"path": "relative"}}, "path"),
        ("POST", "/v1/sandboxes", {"json": {"ttl_seconds": -1}}, "ttl_seconds"),
        ("PATCH", f"{base}/lifecycle", {"json": {"ttl_seconds": -1}}, "ttl_seconds"),
        ("POST", f"{base}/exec", {"json": {"cmd": "true", "timeout_seconds": -1}}, "timeout_seconds"),
        ("POST", "/v1/sandboxes", {"content": b"[" * 100_000 + b"]" * 100_000}, "JSON"),
        ("POST", f"{base}/exec", {"content": b'{"cmd": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"}, "JSON"),
        ("DELETE", f"{base}/fs", {"params": {"path": "/."}}, "path"),
        ("DELETE", f"{base}/fs", {"params": {"path": "//"}}, "path"),
        ("DELETE", f"{base}/fs", {"params": {"path": "/./."}}, "path"),
    ]
    for method, url, kwargs, field in cases:
        started = time.monotonic()
        r = http.request(method, url, **kwargs)
        assert time.monotonic() - started < 5.0, (method, url)  # no stall (a loaded host: seconds)
        assert r.status_code == 400, (method, url, kwargs.get("params"), r.status_code, r.text[:200])
        assert r.headers["content-type"].startswith("application/json")
        assert field in r.json()["error"], (url, r.json())
    assert sb.filesystem.read("/work/keep") == b"keep\n"
    assert sb.exec("echo alive").stdout == "alive\n"
    assert [s.id for s in client.sandboxes.list()] == [sb.id]


def test_agent_socket_and_its_directory_are_private_whatever_the_umask(small_server: LocalServer) -> None:
    c = small_server.client()
    sb = c.sandboxes.create(template="small")
    directory = small_server.state_dir / "sandboxes" / sb.id
    # gVisor: the agent binds its socket in a subdirectory bound into the sandbox (0700 too).
    sock = directory / "s" / "agent.sock" if GVISOR else directory / "agent.sock"
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700, oct(sock.parent.stat().st_mode)
    assert stat.S_ISSOCK(sock.stat().st_mode)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700, oct(directory.stat().st_mode)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600, oct(sock.stat().st_mode)
    c.sandboxes.delete(sb.id)

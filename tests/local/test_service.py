"""The local server as a service (issue 24): crash semantics, hostile clients, caps said on the wire.

- A SIGKILLed server takes every sandbox with it, the ones being created at that moment too.
- Header, body and keep-alive timeouts; connection caps per client address and in total, with a
  JSON refusal; a log that a flood cannot grow.
- A total cap on the memory the server holds for slow readers of ``exec/stream``.
- 405 with the full ``Allow``; ``Retry-After`` on every capacity refusal; no sandbox without a TTL
  unless it asked to be persistent; strict input types.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from pandastack_local import LocalServer
from tests.support import procs


def instance_marker(server: LocalServer) -> bytes:
    """What names this server's sandboxes on the host: its cgroups' base name."""
    instance = hashlib.sha256(str(server.state_dir.resolve()).encode()).hexdigest()[:12]
    return f"pandastack-local-{instance}".encode()


def sandbox_processes(server: LocalServer, known: dict[int, str | None]) -> dict[int, bytes]:
    """Every host process of ``server``'s sandboxes: in one of its cgroups, naming its state dir
    on the command line (runsc), or a process seen below the server before it died (same start
    time: the same process, not a reused pid)."""
    marker = instance_marker(server)
    state = str(server.state_dir.resolve()).encode()
    found: dict[int, bytes] = {}
    for pid in procs.pids():
        cmdline = (procs.read_proc(pid, "cmdline") or b"").replace(b"\0", b" ")
        if marker in (procs.read_proc(pid, "cgroup") or b"") or state in cmdline:
            found[pid] = cmdline
    for pid, start in known.items():
        if pid not in found and start is not None and procs.starttime(pid) == start:
            found[pid] = (procs.read_proc(pid, "cmdline") or b"").replace(b"\0", b" ")
    return found


def children(pid: int) -> set[int]:
    """The direct children of every thread of ``pid``."""
    out: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                out.update(int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split())
    return out


def catch_a_spawn(server_pid: int, seconds: float) -> dict[int, str | None]:
    """SIGSTOP the server's new children that have not reached the sandbox's own first program
    (bwrap or runsc) yet: each is a sandbox caught mid-create. Returns {pid: start time}."""
    caught: dict[int, str | None] = {}
    seen = children(server_pid)
    deadline = time.monotonic() + seconds
    while len(caught) < 2 and time.monotonic() < deadline:
        for pid in children(server_pid) - seen:
            seen.add(pid)
            program = (procs.read_proc(pid, "cmdline") or b"").split(b"\0")[0]
            if not program.endswith((b"/bwrap", b"runsc")):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGSTOP)
                    caught[pid] = procs.starttime(pid)
    return caught


def test_sigkilled_server_takes_every_sandbox_along_even_mid_create() -> None:
    """SIGKILL the server (as the OOM killer would) while creates are in flight: 10 s later no
    process of any of its sandboxes runs, with no restart to reap them.

    Two rounds, each with eight clients creating as fast as the server starts sandboxes (cold: no
    pool; each client deletes what it created). Right before the kill, new children of the server
    that have not reached bwrap (runsc) yet are stopped (SIGSTOP), and let go (SIGCONT) after it: a
    sandbox caught between its first process's fork and its parent-death signal stays caught there
    when the server dies, instead of that window (a few ms) being a matter of luck."""
    survivors: dict[int, bytes] = {}
    servers: list[LocalServer] = []
    try:
        for round_ in range(2):
            server = LocalServer(pool_size=0, max_sandboxes=None)
            servers.append(server)
            server.start()
            stop = threading.Event()
            created: list[str] = []

            def create_loop(
                server: LocalServer = server, stop: threading.Event = stop, created: list[str] = created
            ) -> None:
                auth = {"Authorization": f"Bearer {server.api_key}"}
                with httpx.Client(base_url=server.url, headers=auth, timeout=30) as http:
                    while not stop.is_set():
                        try:
                            r = http.post("/v1/sandboxes", json={"template": "base"})
                        except httpx.HTTPError:
                            return
                        if r.status_code == 201:
                            created.append(r.json()["id"])
                            with contextlib.suppress(httpx.HTTPError):
                                http.delete(f"/v1/sandboxes/{created[-1]}")

            threads = [threading.Thread(target=create_loop, daemon=True) for _ in range(8)]
            for t in threads:
                t.start()
            time.sleep(1.0)
            proc = server._proc
            assert proc is not None
            caught = catch_a_spawn(proc.pid, 20)
            below = {pid: procs.starttime(pid) for pid in procs.descendants(proc.pid)}
            proc.kill()  # the server alone, by SIGKILL: no shutdown runs
            proc.wait()
            for pid, start in caught.items():
                if procs.starttime(pid) == start:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGCONT)
            stop.set()
            for t in threads:
                t.join(timeout=30)
            assert created, f"round {round_}: no create went through before the kill"
            assert caught, f"round {round_}: no create was caught mid-spawn"
            time.sleep(10)
            survivors.update(sandbox_processes(server, below | caught))
    finally:
        # What outlived its server is killed and reaped here (on today's code a restart would do it).
        for pid in survivors:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for server in servers:
            server._proc = None
            server._reap()
            server.close()
    assert not survivors, f"{len(survivors)} sandbox process(es) outlived their server: " + "; ".join(
        f"{pid}: {cmd[:120]!r}" for pid, cmd in sorted(survivors.items())
    )

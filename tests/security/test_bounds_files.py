"""Issue 12, crossing 2: no file a job leaves behind can make the server hoard memory or hang.

A job controls every file in its sandbox: it can point its result at ``/dev/zero``,
make it a FIFO nobody writes, a socket, a 1 TiB sparse file or a file that keeps
growing. Through every route that reads a file (fs read, the core's result and
collected files, a detached job's output) the server reads at most its documented
cap, refuses what is not a regular file with a JSON 4xx at once, and the core
dead-letters the job (the job's own fault) in seconds, with the server's RSS
barely moving. Memory is measured on a private server from ``/proc/<pid>/status``;
a watchdog kills that server if it ever grows past a ceiling, so a regression fails
the test instead of taking the machine down.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from pandastack_jobs import (
    FailureClass,
    JobOutcome,
    JobSpec,
    finish_detached,
    run_job,
)
from pandastack_local import LocalServer

from .bounds_support import MiB, RssWatch, client_fixture, detached_started, http_fixture, server_fixture  # noqa: F401

FAST = 5.0  # seconds: the C2 job ends this fast


# What a hostile job leaves at a path: each must be refused or capped, never read whole.
HOSTILE_FILES = {
    "symlink-to-dev-zero": "ln -sf /dev/zero {p}",
    "symlink-to-urandom": "ln -sf /dev/urandom {p}",
    "fifo": "mkfifo {p}",
    "socket": "python3 -c 'import socket,sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' {p}",
    "sparse-1TiB": "truncate -s 1T {p}",
    "growing": "(yes pandastack > {p} &) ; sleep 0.3",
}


def bounded_job(server: LocalServer, client: Any, spec: JobSpec) -> tuple[JobOutcome, float]:
    """Run ``spec`` through the core; fail if the server's RSS grew past the limit meanwhile."""
    assert server.pid is not None
    with RssWatch(server.pid) as watch:
        started = time.monotonic()
        outcome = run_job(client, spec)
        elapsed = time.monotonic() - started
    watch.check()
    return outcome, elapsed


@pytest.mark.parametrize("kind", sorted(HOSTILE_FILES))
def test_result_file_attack_is_dead_letter_fast_and_bounded(
    server: LocalServer, client: Any, kind: str
) -> None:
    """C2 itself: the result is the hostile file. The core refuses it (type or size) and the job
    is dead-lettered; the server neither hangs nor grows."""
    spec = JobSpec(command=HOSTILE_FILES[kind].format(p="/work/result.json"), timeout=30)
    outcome, elapsed = bounded_job(server, client, spec)
    assert outcome.failure_class is FailureClass.DEAD_LETTER, outcome.summary()
    assert elapsed < FAST, f"{kind}: took {elapsed:.1f}s ({outcome.reason})"
    assert "result" in outcome.reason


@pytest.mark.parametrize("kind", ["symlink-to-dev-zero", "fifo", "sparse-1TiB"])
def test_collected_file_attack_is_dead_letter_fast_and_bounded(
    server: LocalServer, client: Any, kind: str
) -> None:
    cmd = 'echo "{}" > /work/result.json && ' + HOSTILE_FILES[kind].format(p="/work/out.bin")
    spec = JobSpec(command=cmd, collect=["/work/out.bin"], timeout=30)
    outcome, elapsed = bounded_job(server, client, spec)
    assert outcome.failure_class is FailureClass.DEAD_LETTER, outcome.summary()
    assert elapsed < FAST and "/work/out.bin" in outcome.reason


@pytest.mark.parametrize("kind", sorted(HOSTILE_FILES))
def test_fs_read_refuses_or_caps_every_hostile_file(
    server: LocalServer, client: Any, http: httpx.Client, kind: str
) -> None:
    """GET fs on the hostile file: a JSON 4xx naming the reason, fast, with bounded memory."""
    sb = client.sandboxes.create(template="base")
    sb.exec(HOSTILE_FILES[kind].format(p="/tmp/hostile"))
    assert server.pid is not None
    with RssWatch(server.pid) as watch:
        started = time.monotonic()
        r = http.get(f"/v1/sandboxes/{sb.id}/fs", params={"path": "/tmp/hostile"})
        elapsed = time.monotonic() - started
    watch.check()
    assert 400 <= r.status_code < 500, (r.status_code, r.content[:200])
    assert r.headers["content-type"].startswith("application/json")
    message = r.json()["error"]
    assert "/tmp/hostile" in message
    assert ("not a regular file" in message) or ("cap" in message), message
    assert elapsed < FAST


def test_fs_write_to_a_fifo_does_not_hang(client: Any, http: httpx.Client) -> None:
    sb = client.sandboxes.create(template="base")
    sb.exec("mkfifo /tmp/pipe")
    started = time.monotonic()
    r = http.put(f"/v1/sandboxes/{sb.id}/fs", params={"path": "/tmp/pipe"}, content=b"x")
    assert time.monotonic() - started < FAST
    assert r.status_code == 400 and "not a regular file" in r.json()["error"], r.text


def test_fs_read_of_a_regular_file_at_the_cap_still_works(client: Any) -> None:
    """The cap is a cap, not a new limit on normal use: a 32 MiB file reads back whole."""
    sb = client.sandboxes.create(template="base")
    sb.exec("head -c 33554432 /dev/urandom > /tmp/big")
    assert len(sb.filesystem.read("/tmp/big")) == 32 * MiB
    sb.exec("head -c 1 /dev/zero >> /tmp/big")
    with pytest.raises(Exception, match="over the 33554432-byte read cap"):
        sb.filesystem.read("/tmp/big")


def test_detached_output_attack_is_bounded(server: LocalServer, client: Any) -> None:
    """A detached job that swaps its captured stdout for /dev/zero: finishing it stays fast and
    small, and its (valid) result still comes back."""
    cmd = 'ln -sf /dev/zero /work/.pandastack/stdout; echo "{\\"ok\\": 1}" > /work/result.json'
    spec = JobSpec(command=cmd, timeout=30)
    job = detached_started(client, spec, timeout=20)
    assert server.pid is not None
    with RssWatch(server.pid) as watch:
        started = time.monotonic()
        outcome = finish_detached(client, spec, job)  # type: ignore[arg-type]
        elapsed = time.monotonic() - started
    watch.check()
    assert elapsed < FAST
    assert outcome.ok and outcome.result == {"ok": 1}, outcome.summary()

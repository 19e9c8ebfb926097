"""Helpers for the tests/security/test_bounds_* suites: a process's RSS, measured from /proc,
and the suite's private server (a watchdog may kill it: it is restarted) with SDK and raw-HTTP
clients.

The fixtures are named with ``name=`` (``server``, ``client``, ``http``): a test module
imports ``server_fixture, client_fixture, http_fixture`` and asks for them by those names."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pandastack_local import LocalServer
from pandastack_local.testing.procs import rss_kb

MiB = 1024 * 1024
RSS_GROWTH_LIMIT = 64 * MiB  # issue 12: the server's RSS grows by less than this
WATCHDOG_CEILING = 768 * MiB  # past this the wall has failed: stop the server before the host suffers


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    return rss_kb(pid, field) * 1024


class RssWatch:
    """The peak RSS growth of a process over a block (VmHWM reset first, plus sampling), with a
    watchdog that SIGKILLs the process past ``ceiling`` bytes of growth."""

    def __init__(self, pid: int, ceiling: int = WATCHDOG_CEILING) -> None:
        self.pid = pid
        self.ceiling = ceiling
        self.baseline = 0
        self.peak = 0
        self.killed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            try:
                rss = rss_bytes(self.pid)
            except OSError:
                return
            self.peak = max(self.peak, rss)
            if rss - self.baseline > self.ceiling:
                self.killed = True
                os.kill(self.pid, signal.SIGKILL)
                return

    def __enter__(self) -> RssWatch:
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM: the peak below is this block's
        self.baseline = self.peak = rss_bytes(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if not self.killed:
            self.peak = max(self.peak, rss_bytes(self.pid, "VmHWM"))

    @property
    def growth(self) -> int:
        return self.peak - self.baseline

    def check(self) -> None:
        assert not self.killed, f"server RSS grew past {self.ceiling // MiB} MiB: the watchdog killed it"
        assert self.growth < RSS_GROWTH_LIMIT, f"server RSS grew by {self.growth / MiB:.1f} MiB"


@pytest.fixture(name="server")
def server_fixture(security_server: LocalServer) -> LocalServer:
    """The suite's private server (tests/security/conftest.py), restarted on the same port, key and
    state dir if a watchdog killed it."""
    if not security_server.running():
        security_server.restart()
    return security_server


@pytest.fixture(name="client")
def client_fixture(server: LocalServer) -> Iterator[Any]:
    """An SDK client; every sandbox left on the server is deleted after the test."""
    c = server.client()
    yield c
    if server.running():
        for sb in c.sandboxes.list():
            c.sandboxes.delete(sb.id)


@pytest.fixture(name="http")
def http_fixture(server: LocalServer) -> Iterator[httpx.Client]:
    auth = {"Authorization": f"Bearer {server.api_key}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=30) as c:
        yield c


def detached_started(client: Any, spec: Any, timeout: float) -> Any:
    """A detached job of ``spec``, waited on (polling, with a deadline) until it has ended."""
    from pandastack_jobs.detached import poll_detached, start_detached

    job = start_detached(client, spec)
    assert not hasattr(job, "ok"), job  # started, not refused
    deadline = time.monotonic() + timeout
    while poll_detached(client, job.sandbox_id) is None:
        assert time.monotonic() < deadline, f"the detached job did not end in {timeout} s"
        time.sleep(0.1)
    return job

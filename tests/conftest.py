"""Shared fixtures: a real pandastack-local server, SDK clients, and a leak guard.

- ``local_server``: one LocalServer (subprocess, real isolation) for the session.
- ``ps_client``: a fresh ``pandastack.Client`` pointed at it; ``local_http``: raw HTTP to it.
- ``make_local_server(**opts)``: a private server with special options
  (max_sandboxes=1, a short ttl_scan_interval, template_dirs, ...), closed after the test.
- leak guard (in effect for every test that uses ``local_server`` or the reliability suite's
  ``rel_server``): after the test, the server must hold zero sandboxes; leftovers are deleted
  and the test fails naming them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from pandastack_local import LocalServer
from tests.support.server import fail_on_leftovers

if TYPE_CHECKING:
    from e2e.brokers import LazyBrokers


@pytest.fixture(scope="session")
def local_server() -> Iterator[LocalServer]:
    with LocalServer() as server:
        yield server


@pytest.fixture(scope="session")
def brokers() -> Iterator[LazyBrokers]:
    """The session's real brokers (tests/queue and tests/celery_tasks), each started when a test
    first asks for it, all stopped at the end."""
    from e2e.brokers import lazy_brokers  # only the sessions that start a broker import it

    with lazy_brokers() as started:
        yield started


@pytest.fixture
def ps_client(local_server: LocalServer) -> Any:
    return local_server.client()


@pytest.fixture
def local_http(local_server: LocalServer) -> Iterator[httpx.Client]:
    """Raw HTTP to ``local_server``, with its key (for what the SDK does not send or hides)."""
    headers = {"Authorization": f"Bearer {local_server.api_key}"}
    with httpx.Client(base_url=local_server.url, headers=headers, timeout=60) as c:
        yield c


@pytest.fixture
def make_local_server() -> Iterator[Callable[..., LocalServer]]:
    servers: list[LocalServer] = []

    def factory(**opts: Any) -> LocalServer:
        server = LocalServer(**opts)
        servers.append(server)
        return server.start()

    yield factory
    for server in servers:
        server.close()


# The servers whose tests must leave zero sandboxes (``rel_server``: tests/reliability/conftest.py).
GUARDED_SERVERS = ("local_server", "rel_server")


@pytest.fixture(autouse=True)
def _no_leftover_sandboxes(request: pytest.FixtureRequest) -> Iterator[None]:
    servers = [request.getfixturevalue(name) for name in GUARDED_SERVERS if name in request.fixturenames]
    yield
    for server in servers:
        fail_on_leftovers(server)

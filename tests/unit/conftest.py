"""The unit tier: no server, no sandbox, no root, no template, no network.

Every PandaStack call goes to :class:`pandastack_jobs.testing.FakeClient` (the real SDK with
its wire in memory). A test that reaches for the real server's fixtures fails at once, so the
tier cannot quietly grow an integration test.
"""

from __future__ import annotations

import pytest

from pandastack_jobs.testing import FakeClient

SERVER_FIXTURES = ("local_server", "ps_client", "local_http", "make_local_server", "rel_server")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ())) & set(SERVER_FIXTURES)
        if used and "tests/unit/" in str(item.fspath):
            raise pytest.UsageError(f"{item.nodeid}: the unit tier must not use {sorted(used)}")


@pytest.fixture
def fake() -> FakeClient:
    """A fresh in-memory PandaStack."""
    return FakeClient()

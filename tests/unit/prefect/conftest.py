"""Prefect-side unit tests: no Prefect API (an ephemeral one is refused, so a test that reaches
for it fails at once instead of starting a server) and no PandaStack server (FakeClient)."""

from __future__ import annotations

import os
import tempfile

import pytest

from pandastack_jobs import ConnectionConfig
from pandastack_jobs.testing import FakeClient

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="ps-unit-prefect-"))
os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = "false"
os.environ.pop("PREFECT_API_URL", None)


@pytest.fixture
def wired(fake: FakeClient, monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    """Every credentials block's client is the fake."""
    monkeypatch.setattr(ConnectionConfig, "client", lambda self: fake)
    return fake

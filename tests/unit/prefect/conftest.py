"""Prefect-side unit tests: no Prefect API and no PandaStack server (FakeClient). Nothing here
starts an ephemeral Prefect API: the tier passes in a network namespace without even loopback."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from pandastack_jobs import ConnectionConfig
from pandastack_jobs.testing import FakeClient

_OWN_HOME = "PREFECT_HOME" not in os.environ
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="ps-unit-prefect-"))


@pytest.fixture
def wired(fake: FakeClient, monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    """Every credentials block's client is the fake."""
    monkeypatch.setattr(ConnectionConfig, "client", lambda self: fake)
    return fake


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove the private PREFECT_HOME this run made."""
    if _OWN_HOME:
        shutil.rmtree(os.environ["PREFECT_HOME"], ignore_errors=True)

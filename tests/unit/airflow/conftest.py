"""Airflow-side unit tests: a private AIRFLOW_HOME (set before Airflow is imported), no DB
migration, no server: the executor runs on :class:`FakeSandboxDriver`, operators on
:class:`FakeClient`."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from pandastack_jobs import ConnectionConfig
from pandastack_jobs.testing import FAKE_KEY, FAKE_URL, FakeClient
from pandastack_local.testing.airflow_env import isolate_airflow_home

assert "airflow" not in sys.modules or os.environ.get("PANDASTACK_TEST_AIRFLOW_HOME"), (
    "airflow was imported before tests/unit/airflow/conftest.py could isolate AIRFLOW_HOME"
)
_OWN_HOME = not os.environ.get("PANDASTACK_TEST_AIRFLOW_HOME")
AIRFLOW_ENV = isolate_airflow_home("ps-unit-airflow-")
os.environ.pop("PANDASTACK_API_KEY", None)
os.environ.pop("PANDASTACK_API", None)


@pytest.fixture
def wired(fake: FakeClient, monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    """Every hook's connection resolves to the fake (no Airflow connection lookup)."""
    from airflow_provider.hooks.pandastack import PandaStackHook

    monkeypatch.setattr(PandaStackHook, "config", property(lambda self: ConnectionConfig(FAKE_URL, FAKE_KEY)))
    monkeypatch.setattr(ConnectionConfig, "client", lambda self: fake)
    return fake


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove the private AIRFLOW_HOME this run made (a reused one is the caller's)."""
    if _OWN_HOME:
        shutil.rmtree(AIRFLOW_ENV["AIRFLOW_HOME"], ignore_errors=True)

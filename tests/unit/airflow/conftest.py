"""Airflow-side unit tests: a private AIRFLOW_HOME (set before Airflow is imported), no DB
migration, no server: the executor runs on :class:`FakeSandboxDriver`, operators on
:class:`FakeClient`."""

from __future__ import annotations

import os
import sys

import pytest

from pandastack_jobs import ConnectionConfig
from pandastack_jobs.testing import FAKE_KEY, FAKE_URL, FakeClient
from tests.support.airflow_env import isolate_airflow_home

assert "airflow" not in sys.modules or os.environ.get("PANDASTACK_TEST_AIRFLOW_HOME"), (
    "airflow was imported before tests/unit/airflow/conftest.py could isolate AIRFLOW_HOME"
)
isolate_airflow_home("ps-unit-airflow-")
os.environ.pop("PANDASTACK_API_KEY", None)
os.environ.pop("PANDASTACK_API", None)


@pytest.fixture
def wired(fake: FakeClient, monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    """Every hook's connection resolves to the fake (no Airflow connection lookup)."""
    from airflow_provider.hooks.pandastack import PandaStackHook

    monkeypatch.setattr(PandaStackHook, "config", property(lambda self: ConnectionConfig(FAKE_URL, FAKE_KEY)))
    monkeypatch.setattr(ConnectionConfig, "client", lambda self: fake)
    return fake

"""Airflow-side unit tests: a private AIRFLOW_HOME (set before Airflow is imported), no DB
migration, no server: the executor runs on :class:`FakeSandboxDriver`, operators on
:class:`FakeClient`."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pandastack_jobs import ConnectionConfig
from pandastack_jobs.testing import FAKE_KEY, FAKE_URL, FakeClient
from pandastack_local.testing.airflow_env import isolate_airflow_home

if TYPE_CHECKING:
    from airflow_provider.executors.testing import FakeClock, FakeSandboxDriver

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


# -- the executor's unit tests: FakeSandboxDriver behind a real PandaStackExecutor ---------------


@pytest.fixture
def logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__POLL_INTERVAL", "0.001")
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__ORPHAN_SWEEP_INTERVAL", "0")
    monkeypatch.setenv(
        "AIRFLOW__PANDASTACK_EXECUTOR__EXECUTION_API_SERVER_URL", "http://api.invalid/execution/"
    )
    monkeypatch.setenv("AIRFLOW__LOGGING__BASE_LOG_FOLDER", str(tmp_path))
    return tmp_path


@pytest.fixture
def clock() -> FakeClock:
    """The executors' and the driver's time: it moves only when a test (or beat_until) moves it."""
    from airflow_provider.executors.testing import FakeClock

    return FakeClock()


@pytest.fixture
def driver(clock: FakeClock) -> FakeSandboxDriver:
    from airflow_provider.executors.testing import FakeSandboxDriver

    driver = FakeSandboxDriver()
    driver.clock = clock
    return driver


@pytest.fixture
def make_executor(logs: Path, driver: FakeSandboxDriver, clock: FakeClock) -> Iterator[Callable[..., Any]]:
    """Started executors on ``driver`` (settings from the environment as it is when called): each
    driver call settled when submitted (SettledLoop), time on ``clock`` (waits are skipped)."""
    from airflow_provider.executors import PandaStackExecutor
    from airflow_provider.executors.testing import SettledLoop

    made: list[Any] = []

    def make(parallelism: int = 8) -> Any:
        made.append(PandaStackExecutor(parallelism=parallelism))
        made[-1].make_driver = lambda: driver
        made[-1].make_loop = SettledLoop
        made[-1].clock, made[-1].sleep = clock, clock.advance
        made[-1].start()
        return made[-1]

    yield make
    for ex in made:
        ex.shutdown_timeout = 2
        ex.end()


@pytest.fixture
def executor(make_executor: Callable[..., Any]) -> Any:
    return make_executor()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove the private AIRFLOW_HOME this run made (a reused one is the caller's)."""
    if _OWN_HOME:
        shutil.rmtree(AIRFLOW_ENV["AIRFLOW_HOME"], ignore_errors=True)

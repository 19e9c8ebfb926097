"""Airflow test environment: an isolated AIRFLOW_HOME with SQLite, migrated once per session,
and the ``pandastack_default`` connection pointing at the shared local PandaStack server.

The environment is set at import time, before anything imports Airflow (its
configuration is read once, on first import).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pandastack_local.testing.airflow_env import isolate_airflow_home
from tests.support.dagtest import connection_env, migrate_db

assert "airflow" not in sys.modules or os.environ.get("PANDASTACK_TEST_AIRFLOW_HOME"), (
    "airflow was imported before tests/airflow/conftest.py could isolate AIRFLOW_HOME"
)

AIRFLOW_ENV = isolate_airflow_home()
os.environ.pop("PANDASTACK_API_KEY", None)
os.environ.pop("PANDASTACK_API", None)


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """``airflow db migrate`` once per session (SQLite in the isolated AIRFLOW_HOME)."""
    return migrate_db()


@pytest.fixture(scope="session")
def airflow_env(airflow_db: Path, local_server: Any) -> Iterator[dict[str, str]]:
    """The Airflow environment with ``pandastack_default`` pointing at the local server."""
    env = connection_env(local_server)
    os.environ.update(env)
    yield {**AIRFLOW_ENV, **env}
    for name in env:
        os.environ.pop(name, None)

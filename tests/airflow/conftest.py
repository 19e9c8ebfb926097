"""Airflow test environment: an isolated AIRFLOW_HOME with SQLite, migrated once per session,
and the ``pandastack_default`` connection pointing at the shared local PandaStack server.

The environment is set at import time, before anything imports Airflow (its
configuration is read once, on first import).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dagtest import airflow_cli, connection_env

assert "airflow" not in sys.modules or os.environ.get("PANDASTACK_TEST_AIRFLOW_HOME"), (
    "airflow was imported before tests/airflow/conftest.py could isolate AIRFLOW_HOME"
)

AIRFLOW_HOME = Path(os.environ.get("PANDASTACK_TEST_AIRFLOW_HOME") or tempfile.mkdtemp(prefix="ps-airflow-"))
(AIRFLOW_HOME / "dags").mkdir(parents=True, exist_ok=True)
AIRFLOW_ENV = {
    "PANDASTACK_TEST_AIRFLOW_HOME": str(AIRFLOW_HOME),
    "AIRFLOW_HOME": str(AIRFLOW_HOME),
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{AIRFLOW_HOME}/airflow.db",
    "AIRFLOW__CORE__DAGS_FOLDER": str(AIRFLOW_HOME / "dags"),
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    "AIRFLOW__CORE__TEST_CONNECTION": "Enabled",
    "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
    "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
}
os.environ.update(AIRFLOW_ENV)
os.environ.pop("PANDASTACK_API_KEY", None)
os.environ.pop("PANDASTACK_API", None)


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """``airflow db migrate`` once per session (SQLite in the isolated AIRFLOW_HOME)."""
    if not (AIRFLOW_HOME / ".migrated").exists():
        proc = airflow_cli("db", "migrate")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        (AIRFLOW_HOME / ".migrated").touch()
    return AIRFLOW_HOME


@pytest.fixture(scope="session")
def airflow_env(airflow_db: Path, local_server: Any) -> Iterator[dict[str, str]]:
    """The Airflow environment with ``pandastack_default`` pointing at the local server."""
    env = connection_env(local_server)
    os.environ.update(env)
    yield {**AIRFLOW_ENV, **env}
    for name in env:
        os.environ.pop(name, None)

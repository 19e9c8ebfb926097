"""An isolated Airflow environment for tests: a private AIRFLOW_HOME with SQLite.

Only environment variables (no Airflow import), so a conftest can call it at import time, before
anything imports Airflow (its configuration is read once, on first import), and in the Prefect
venv, where it is harmless.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def isolate_airflow_home(prefix: str = "ps-airflow-") -> dict[str, str]:
    """Point Airflow at a private home (reused from ``PANDASTACK_TEST_AIRFLOW_HOME`` if set)."""
    home = Path(os.environ.get("PANDASTACK_TEST_AIRFLOW_HOME") or tempfile.mkdtemp(prefix=prefix))
    (home / "dags").mkdir(parents=True, exist_ok=True)
    env = {
        "PANDASTACK_TEST_AIRFLOW_HOME": str(home),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__TEST_CONNECTION": "Enabled",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
    }
    os.environ.update(env)
    return env

"""An isolated Airflow environment for tests: a private AIRFLOW_HOME with SQLite.

Only environment variables (no Airflow import), so a conftest can call it at import time, before
anything imports Airflow (its configuration is read once, on first import), and in the Prefect
venv, where it is harmless.
"""

from __future__ import annotations

import base64
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


def api_server_env(api_port: int) -> dict[str, str]:
    """Airflow settings for an api-server on loopback ``api_port`` that task runners reach through
    the Execution API: fresh fernet key and JWT secret, simple auth with everyone an admin."""
    base = f"http://127.0.0.1:{api_port}"
    return {
        "AIRFLOW__CORE__FERNET_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{base}/execution/",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__API__BASE_URL": base,
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API_AUTH__JWT_SECRET": base64.urlsafe_b64encode(os.urandom(32)).decode(),
    }

"""The floor-version legs (``make test-floors``): Airflow 3.1 and 3.2, Prefect 3.6, one real
run each with a redelivered failure. Runs in whichever engine's venv it is given; the Airflow
environment is isolated at import time, before anything imports Airflow (as tests/airflow does)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pandastack_local.testing.airflow_env import isolate_airflow_home

HAS_AIRFLOW = importlib.util.find_spec("airflow") is not None
HAS_PREFECT = importlib.util.find_spec("prefect") is not None

if HAS_AIRFLOW:
    AIRFLOW_ENV = isolate_airflow_home("ps-floor-airflow-")
    os.environ.pop("PANDASTACK_API_KEY", None)
    os.environ.pop("PANDASTACK_API", None)

    @pytest.fixture(scope="session")
    def airflow_env(local_server: Any) -> Iterator[dict[str, str]]:
        from tests.support.dagtest import airflow_cli, connection_env

        home = Path(os.environ["AIRFLOW_HOME"])
        if not (home / ".migrated").exists():  # no cached DB: another Airflow's schema
            proc = airflow_cli("db", "migrate", timeout=300)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            (home / ".migrated").touch()
        env = connection_env(local_server)
        os.environ.update(env)
        yield {**AIRFLOW_ENV, **env}


if HAS_PREFECT:
    from tests.support.prefect_fixtures import fast_redelivery, prefect_api

    __all__ = ["fast_redelivery", "prefect_api"]

collect_ignore = [
    name
    for name, present in (("test_floor_airflow.py", HAS_AIRFLOW), ("test_floor_prefect.py", HAS_PREFECT))
    if not present
]

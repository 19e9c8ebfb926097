"""Reliability suite fixtures: a private pandastack-local server with a small 'hostile' template,
an orchestrator secret it must never leak, and host-side leak checks.

The suite runs in both virtual environments. Engine files skip themselves with
``pytest.importorskip``; the Makefile runs core + Airflow files in ``.venv-airflow`` and the
Prefect file in ``.venv-prefect``. The Airflow environment (an isolated AIRFLOW_HOME) is set
here, at import time, before anything can import Airflow: it is only environment variables,
harmless where Airflow is not installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pandastack_local import LocalServer
from pandastack_local.testing.airflow_env import isolate_airflow_home
from tests.reliability.catalogue import CANARY_NAME, CANARY_VALUE, write_hostile_template
from tests.reliability.probes import HostProbe

if "airflow" not in sys.modules:
    isolate_airflow_home("ps-rel-airflow-")


@pytest.fixture(scope="session")
def rel_templates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hostile_template(tmp_path_factory.mktemp("rel-templates"))


@pytest.fixture(scope="session")
def rel_server(rel_templates: Path) -> Iterator[LocalServer]:
    """A private server whose environment (the orchestrator's) holds a canary secret."""
    os.environ[CANARY_NAME] = CANARY_VALUE  # the orchestrator's own secret, inherited by the server
    server = LocalServer(template_dirs=[str(rel_templates / "hostile")]).start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def host(rel_server: LocalServer) -> HostProbe:
    return HostProbe(rel_server)

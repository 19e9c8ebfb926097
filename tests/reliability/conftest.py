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
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from rel_support import CANARY_NAME, CANARY_VALUE, HostProbe, write_hostile_template

from pandastack_local import LocalServer

if "airflow" not in sys.modules:
    _home = Path(os.environ.get("PANDASTACK_TEST_AIRFLOW_HOME") or tempfile.mkdtemp(prefix="ps-rel-airflow-"))
    (_home / "dags").mkdir(parents=True, exist_ok=True)
    os.environ.update(
        {
            "PANDASTACK_TEST_AIRFLOW_HOME": str(_home),
            "AIRFLOW_HOME": str(_home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_home}/airflow.db",
            "AIRFLOW__CORE__DAGS_FOLDER": str(_home / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        }
    )


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


@pytest.fixture(autouse=True)
def _rel_no_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test on ``rel_server`` must leave zero sandboxes (leftovers are deleted, then fail)."""
    if "rel_server" not in request.fixturenames:
        yield
        return
    server: LocalServer = request.getfixturevalue("rel_server")
    yield
    if not server.running():
        return
    client = server.client()
    leftovers = client.sandboxes.list()
    for sb in leftovers:
        try:
            client.sandboxes.delete(sb.id)
        except Exception:
            pass
    assert not leftovers, f"test left sandboxes: {[(s.id, s.metadata) for s in leftovers]}"

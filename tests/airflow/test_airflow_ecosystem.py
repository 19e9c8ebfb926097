"""The checks Airflow runs on its own providers, run on this one.

- ``get_provider_info()`` validates against ``provider_info.schema.json`` shipped in the
  installed Airflow, and each integration against ``provider.yaml.schema.json`` (whose
  tag list is the one Airflow accepts);
- every example DAG in ``dags/`` parses with no metadata-DB query and no connection or
  variable lookup (each raises while the DAGs are parsed; a control DAG proves the trap);
- importing the package, in a fresh interpreter, emits no deprecation warning (pyproject's
  ``filterwarnings`` ignores them in tests, so the subprocess records them itself).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import airflow
import jsonschema
import pytest

from airflow_provider.get_provider_info import get_provider_info

REPO = Path(__file__).resolve().parents[2]
AIRFLOW_DIR = Path(airflow.__file__).parent


def schema(name: str) -> dict[str, Any]:
    return json.loads((AIRFLOW_DIR / name).read_text())


def test_provider_info_validates_against_airflows_schema() -> None:
    info = get_provider_info()
    jsonschema.validate(info, schema("provider_info.schema.json"))
    # The same checks Airflow's provider loader makes when it discovers the provider.
    from airflow.providers_manager import ProvidersManager
    from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime

    manager = ProvidersManager()
    manager.initialize_providers_list()
    assert info["package-name"] in manager.providers
    hook = ProvidersManagerTaskRuntime().hooks["pandastack"]
    assert hook is not None and hook.hook_name == "PandaStack"


def test_integrations_use_tags_airflow_accepts() -> None:
    integration_schema = schema("provider.yaml.schema.json")["properties"]["integrations"]["items"]
    accepted = set(integration_schema["properties"]["tags"]["items"]["enum"])
    integrations = get_provider_info()["integrations"]
    assert integrations
    for integration in integrations:
        jsonschema.validate(integration, integration_schema)
        assert set(integration["tags"]) <= accepted, (integration["tags"], sorted(accepted))
    names = {i["integration-name"] for i in integrations}
    info = get_provider_info()
    for section in ("hooks", "operators", "triggers"):
        for entry in info[section]:
            assert entry["integration-name"] in names, (section, entry)


class ParseTimeAccess(AssertionError):
    """Raised by the traps: a DAG file touched the metadata DB or a connection while parsing."""


@pytest.fixture
def no_db_or_connections(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Make every metadata-DB query, connection and variable lookup raise (and record it)."""
    import sqlalchemy
    from airflow.models.connection import Connection as ORMConnection
    from airflow.sdk.bases.hook import BaseHook
    from airflow.sdk.execution_time import context

    touched: list[str] = []

    def trap(what: str) -> Any:
        def raise_(*args: Any, **kwargs: Any) -> Any:
            touched.append(what)
            raise ParseTimeAccess(f"{what} while parsing DAG files")

        return raise_

    def on_query(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        trap(f"metadata-DB query {statement.split()[0]}")()

    for name in ("_get_connection", "_async_get_connection", "_get_variable"):
        monkeypatch.setattr(context, name, trap(f"context.{name}"))
    monkeypatch.setattr(BaseHook, "get_connection", classmethod(trap("BaseHook.get_connection")))
    monkeypatch.setattr(
        ORMConnection,
        "get_connection_from_secrets",
        classmethod(trap("Connection.get_connection_from_secrets")),
    )
    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", on_query)
    try:
        yield touched
    finally:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", on_query)


def parse(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.syspath_prepend(str(folder))
    return DagBag(dag_folder=str(folder), safe_mode=False, load_op_links=False)


CONTROL_DAG = """
from airflow.sdk import DAG, BaseHook
from airflow_provider.operators.sandbox import PandaStackSandboxOperator

host = BaseHook.get_connection("pandastack_default").host  # the mistake the traps catch
with DAG("parse_time_lookup", schedule=None):
    PandaStackSandboxOperator(task_id="t", command="true", metadata={"host": host})
"""


def test_the_traps_catch_a_parse_time_connection_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_db_or_connections: list[str]
) -> None:
    (tmp_path / "control_dag.py").write_text(CONTROL_DAG)
    bag = parse(tmp_path, monkeypatch)
    assert not bag.dags
    assert "ParseTimeAccess" in next(iter(bag.import_errors.values()))
    assert no_db_or_connections


def test_example_dags_parse_without_db_or_connection_access(
    monkeypatch: pytest.MonkeyPatch, no_db_or_connections: list[str]
) -> None:
    bag = parse(REPO / "dags", monkeypatch)
    assert bag.import_errors == {}
    assert no_db_or_connections == []
    assert set(bag.dags) == {
        "pandastack_queue_worker",
        "pandastack_scheduled_report",
        "pandastack_tenant_transforms",
        "pandastack_warm_fork_batch",
    }
    for dag in bag.dags.values():
        assert dag.tasks, dag.dag_id


IMPORT_ALL = """
import importlib, json, pkgutil, sys, warnings

import airflow, airflow.sdk  # Airflow's own import is not ours to judge
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import airflow_provider
    names = [m.name for m in pkgutil.walk_packages(airflow_provider.__path__, "airflow_provider.")]
    for name in names:
        importlib.import_module(name)
    from airflow.providers_manager import ProvidersManager
    from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime
    ProvidersManager().initialize_providers_list()
    assert ProvidersManagerTaskRuntime().hooks["pandastack"] is not None
print(json.dumps({
    "modules": names,
    "warnings": [
        {"category": w.category.__name__, "message": str(w.message), "file": w.filename, "line": w.lineno}
        for w in seen
        if issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning))
    ],
}))
"""


def test_importing_the_package_raises_no_deprecation_warning() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "airflow_provider.operators.sandbox" in report["modules"]
    assert report["warnings"] == [], json.dumps(report["warnings"], indent=1)

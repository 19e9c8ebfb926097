"""Helpers to run real DAGs with ``dag.test()`` and read back what Airflow recorded."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import select

AIRFLOW_BIN = str(Path(sys.executable).with_name("airflow"))


def airflow_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """Run the ``airflow`` CLI in this test environment."""
    return subprocess.run(
        [AIRFLOW_BIN, *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def connection_env(
    server: Any, conn_id: str = "pandastack_default", key: str | None = None, create_budget: float = 5
) -> dict[str, str]:
    """``AIRFLOW_CONN_<ID>`` for a local server (JSON form: the API URL goes in ``host``)."""
    value = {
        "conn_type": "pandastack",
        "host": server.url,
        "password": server.api_key if key is None else key,
        "extra": {"max_create_retry_seconds": create_budget},
    }
    return {f"AIRFLOW_CONN_{conn_id.upper()}": json.dumps(value)}


def migrated_db_cache() -> Path:
    """Where this venv keeps a freshly migrated SQLite DB, keyed by every installed distribution.

    ``airflow db migrate`` of an empty SQLite DB yields the same file for the same installed
    Airflow (no connections, only ``default_pool``), so each pytest process of a run (CI has
    about six with Airflow) copies it instead of migrating again. Inside the venv: ``make clean``
    removes it with the venv, and any install or upgrade changes the key.
    """
    dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    key = hashlib.sha256("\n".join(dists).encode()).hexdigest()[:16]
    return Path(sys.prefix) / ".pandastack-test-cache" / f"airflow-migrated-{key}.db"


def migrate_db() -> Path:
    """``airflow db migrate`` once per AIRFLOW_HOME (SQLite); returns the home.

    A fresh home gets a copy of the venv's migrated DB (:func:`migrated_db_cache`) when there is
    one; otherwise it migrates and leaves its DB there for the next process.
    """
    home = Path(os.environ["AIRFLOW_HOME"])
    if not (home / ".migrated").exists():
        cached, db = migrated_db_cache(), home / "airflow.db"
        if cached.exists() and not db.exists():
            shutil.copyfile(cached, db)
        else:
            proc = airflow_cli("db", "migrate", timeout=300)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            if not cached.exists():
                cached.parent.mkdir(exist_ok=True)
                partial = cached.with_suffix(f".{os.getpid()}.partial")
                shutil.copyfile(db, partial)
                partial.replace(cached)  # atomic: a concurrent process sees all of it or nothing
        (home / ".migrated").touch()
    return home


def register(dag: Any) -> None:
    """Serialize ``dag`` into the metadata DB (what the DAG processor would do)."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    DagBundlesManager().sync_bundles_to_db()
    empty = Path(os.environ["AIRFLOW_HOME"]) / "dags"
    bag = DagBag(dag_folder=str(empty))
    bag.bag_dag(dag)
    sync_bag_to_db(bag, "dags-folder", None)


def run_dag(dag: Any, **kwargs: Any) -> Any:
    """Register and run one DagRun of ``dag`` in this process; return the DagRun."""
    register(dag)
    return dag.test(**kwargs)


def task_instances(dr: Any) -> dict[tuple[str, int], Any]:
    """``{(task_id, map_index): TaskInstance}`` of a DagRun, fresh from the DB."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as session:
        tis = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dr.dag_id, TaskInstance.run_id == dr.run_id)
        ).all()
        for ti in tis:
            session.expunge(ti)
    return {(ti.task_id, ti.map_index): ti for ti in tis}


def xcom(dr: Any, task_id: str, key: str = "return_value", map_index: int = -1) -> Any:
    """The XCom value a task instance pushed (None when absent)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalars(
            select(XComModel).where(
                XComModel.dag_id == dr.dag_id,
                XComModel.run_id == dr.run_id,
                XComModel.task_id == task_id,
                XComModel.map_index == map_index,
                XComModel.key == key,
            )
        ).first()
        return None if row is None else XComModel.deserialize_value(row)


def xcoms(dr: Any) -> dict[tuple[str, int, str], Any]:
    """Every XCom of a DagRun: ``{(task_id, map_index, key): value}``."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(
            select(XComModel).where(XComModel.dag_id == dr.dag_id, XComModel.run_id == dr.run_id)
        ).all()
        return {(r.task_id, r.map_index, r.key): XComModel.deserialize_value(r) for r in rows}


def all_xcom_text(dr: Any) -> str:
    """Every XCom value and rendered template field of the run, as one text (for leak checks)."""
    from airflow.models.renderedtifields import RenderedTaskInstanceFields
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        values = [
            str(row.value)
            for row in session.scalars(
                select(XComModel).where(XComModel.dag_id == dr.dag_id, XComModel.run_id == dr.run_id)
            )
        ]
        values += [
            str(row.rendered_fields)
            for row in session.scalars(
                select(RenderedTaskInstanceFields).where(
                    RenderedTaskInstanceFields.dag_id == dr.dag_id,
                    RenderedTaskInstanceFields.run_id == dr.run_id,
                )
            )
        ]
    return "\n".join(values)


def run_next_try(dag: Any, run_id: str, task_id: str, map_index: int = -1) -> Any:
    """Run the next try of a task instance whose worker died, as the scheduler would.

    The scheduler notices the missing heartbeats, fails the try with a retry
    (``up_for_retry``) and schedules the next one with ``try_number + 1``; here
    those state changes are applied directly and the try runs in this process
    through the same runner ``dag.test()`` uses. Returns the TaskInstance.
    """
    from airflow.models.taskinstance import TaskInstance
    from airflow.sdk.definitions.dag import _run_task
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState

    register(dag)
    with create_session() as session:
        ti = session.scalars(
            select(TaskInstance).where(
                TaskInstance.dag_id == dag.dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == task_id,
                TaskInstance.map_index == map_index,
            )
        ).one()
        ti.try_number += 1
        ti.state = TaskInstanceState.SCHEDULED
        session.commit()
        session.refresh(ti)
        session.expunge(ti)
    _run_task(ti=ti, task=dag.task_dict[task_id])
    with create_session() as session:
        return session.scalars(select(TaskInstance).where(TaskInstance.id == ti.id)).one()


def try_history(dr: Any, task_id: str, map_index: int = -1) -> list[Any]:
    """The finished earlier tries of a task instance (TaskInstanceHistory rows), oldest first."""
    from airflow.models.taskinstancehistory import TaskInstanceHistory
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(
            select(TaskInstanceHistory)
            .where(
                TaskInstanceHistory.dag_id == dr.dag_id,
                TaskInstanceHistory.run_id == dr.run_id,
                TaskInstanceHistory.task_id == task_id,
                TaskInstanceHistory.map_index == map_index,
            )
            .order_by(TaskInstanceHistory.try_number)
        ).all()
        for row in rows:
            session.expunge(row)
    return list(rows)

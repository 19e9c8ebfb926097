"""A whole task try through a real Airflow scheduler with ``PandaStackExecutor`` and
``warm_pool_size = 1`` (SQLite, pandastack-local, the api-server): the try runs in a standby, under
its runner, and succeeds, with none of the scheduler's secrets in its processes' environments;
the scheduler's stop (the executor's ``end``) deletes the pool's standby.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from airflow_provider.executors.models import SandboxExecutionRef
from pandastack_jobs.warm_start import CHECK_COMMAND, STANDBY_LABEL
from pandastack_local.testing.executor_stack import pandastack_executor_stack, scheduler_home

REPO = Path(__file__).resolve().parents[2]
DAG_FILE = Path(__file__).with_name("executor_dags") / "pandastack_executor_warm.py"
DAG_ID = "pandastack_executor_warm"


def standbys(client: object) -> list[str]:
    return [sb.id for sb in client.sandboxes.list() if STANDBY_LABEL in (sb.metadata or {})]  # type: ignore[attr-defined]


def ready(client: object) -> bool:
    """One standby exists and its runner listens (the pool's own liveness check)."""
    ids = standbys(client)
    return (
        len(ids) == 1 and client.sandboxes.get(ids[0]).exec(CHECK_COMMAND, timeout_seconds=30).exit_code == 0
    )  # type: ignore[attr-defined]


@pytest.mark.timeout(1200)
def test_a_try_runs_warm_in_a_standby_and_end_closes_the_pool(airflow_db: Path) -> None:
    home, dags = scheduler_home(airflow_db / "airflow.db", DAG_FILE, "ps-executor-warm-")
    stack = pandastack_executor_stack(home, dags, REPO, "1")
    client = stack.server.client()
    try:
        deadline = time.monotonic() + 300
        while not ready(client) and time.monotonic() < deadline:  # the runner imports the Task SDK
            time.sleep(1)
        time.sleep(1)  # the pool marks it ready right after its runner listens
        standby = standbys(client)
        run_id = stack.trigger(DAG_ID)
        assert stack.wait_run(DAG_ID, run_id) == "success", stack.log_tail("scheduler")
        path = f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/where/xcomEntries/return_value"
        report = stack.rest("GET", path + "?deserialize=true")["value"]
        assert "warm_runner.py" in report["parent"], report  # the Task SDK ran in the runner's fork
        assert report["sandbox_id"] in standby  # in the standby that was waiting
        # The standby's processes (its runner, the try) hold none of the scheduler's secrets.
        haystack = "\n".join(report["environ"])
        assert f"PYTHONPATH={REPO}" in haystack  # the search sees the section's env
        for secret in (
            stack.env["AIRFLOW__CORE__FERNET_KEY"],
            stack.env["AIRFLOW__API_AUTH__JWT_SECRET"],
            stack.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"],
            stack.server.api_key,
        ):
            assert secret not in haystack
        (external,) = stack.query(
            "select external_executor_id from task_instance where dag_id=? and run_id=?", DAG_ID, run_id
        )[0]
        ref = SandboxExecutionRef.decode(external, expected_driver="pandastack")
        assert ref is not None and ref.handle.data.get("standby")
        # The pool refills; the try's own sandbox is deleted once it ended.
        deadline = time.monotonic() + 120
        while (
            report["sandbox_id"] in {sb.id for sb in client.sandboxes.list()} and time.monotonic() < deadline
        ):
            time.sleep(1)
        assert report["sandbox_id"] not in {sb.id for sb in client.sandboxes.list()}
        stack.stop()  # SIGTERM: the scheduler ends its executor, which closes the pool
        deadline = time.monotonic() + 60
        while standbys(client) and time.monotonic() < deadline:
            time.sleep(1)
        assert standbys(client) == [], stack.log_tail("scheduler")
    finally:
        stack.stop()
        for sb in client.sandboxes.list():
            sb.kill()
        stack.server.close()
        shutil.rmtree(home, ignore_errors=True)

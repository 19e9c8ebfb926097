"""Whole task tries through a real Airflow scheduler with ``PandaStackExecutor`` (SQLite).

Started here: pandastack-local with a template that binds this environment (read-only)
and the DAG folder, and an egress allow-list that lets sandboxes reach exactly the
api-server's port; ``airflow api-server`` (the Execution API the tasks call);
``airflow scheduler`` with ``[core] executor = airflow_provider.executors.PandaStackExecutor``.
A DAG of plain ``@task`` / ``PythonOperator`` / ``BashOperator`` tasks is triggered and
every try must run in its own sandbox; one task gathers the sandbox's environment and
files and the test searches them for the secrets the scheduler holds.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider.executors.models import SandboxExecutionRef
from pandastack_jobs.warm_start import CHECK_COMMAND
from pandastack_local.testing.executor_stack import ExecutorStack, pandastack_executor_stack, scheduler_home

REPO = Path(__file__).resolve().parents[2]
STANDBY = "pandastack.standby"
DAG_FILE = Path(__file__).with_name("executor_dags") / "pandastack_executor_try.py"
DAG_ID = "pandastack_executor_try"


# Cold only (``warm_pool_size = 0``, the default). A warm pool changes where a try starts, not
# what these tries prove (a sandbox per try, no secrets, nothing left): the warm path through the
# scheduler, its standby's environment included, is test_airflow_executor_warm.py's (docs/testing.md).
@pytest.fixture(scope="module", params=["0"], ids=["cold"])
def stack(airflow_db: Path, request: pytest.FixtureRequest) -> Iterator[ExecutorStack]:
    """The scheduler stack, cold: the tries, each in a sandbox of its own."""
    # The DB migrated once per session, copied so that test_airflow_kill.py's SIGKILLed worker's
    # commits survive (scheduler_home says how).
    home, dags = scheduler_home(airflow_db / "airflow.db", DAG_FILE, "ps-executor-airflow-")
    stack = pandastack_executor_stack(home, dags, REPO, request.param, {"AIRFLOW__CORE__PARALLELISM": "3"})
    try:
        yield stack
    finally:
        stack.stop()
        for sb in stack.server.client().sandboxes.list():  # only after a failure: the test asserts none
            sb.kill()
        stack.server.close()
        shutil.rmtree(home, ignore_errors=True)


def sandbox_tails(stack: ExecutorStack) -> str:
    """What the still-running sandboxes printed (diagnostics for a run that hangs)."""
    out = []
    for sb in stack.server.client().sandboxes.list():
        res = sb.exec("tail -c 3000 /work/.pandastack/stdout /work/.pandastack/stderr", timeout_seconds=30)
        out.append(f"--- {sb.id} {sb.metadata.get('job_task')}:\n{res.stdout}{res.stderr}")
    return "\n".join(out)


@pytest.mark.timeout(1200)
def test_every_try_runs_in_its_own_sandbox_with_no_secrets(stack: ExecutorStack) -> None:
    warm = stack.env["AIRFLOW__PANDASTACK_EXECUTOR__WARM_POOL_SIZE"] != "0"
    if warm:  # the three standbys ready (their runner listening) before the run
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            ready = [
                sb
                for sb in stack.server.client().sandboxes.list()
                if STANDBY in sb.metadata and sb.exec(CHECK_COMMAND, timeout_seconds=30).exit_code == 0
            ]
            if len(ready) == 3:
                break
            time.sleep(1)
        time.sleep(1)
    run_id = stack.trigger(DAG_ID)
    try:
        state = stack.wait_run(DAG_ID, run_id)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{sandbox_tails(stack)}") from None
    assert state == "failed"  # the task "fails" fails on purpose
    states = dict(
        stack.query("select task_id, state from task_instance where dag_id=? and run_id=?", DAG_ID, run_id)
    )
    assert states == {
        "decorated": "success",
        "python_op": "success",
        "bash_op": "success",
        "secrets_probe": "success",
        "fails": "failed",
    }, stack.log_tail("scheduler")

    def xcom(task_id: str) -> Any:
        path = f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value"
        return stack.rest("GET", path + "?deserialize=true")["value"]

    handles = [
        SandboxExecutionRef.decode(external, expected_driver="pandastack")
        for (external,) in stack.query(
            "select external_executor_id from task_instance where dag_id=? and run_id=?", DAG_ID, run_id
        )
    ]
    ran_warm = sum(1 for ref in handles if ref is not None and ref.handle.data.get("standby"))
    assert ran_warm >= 3 if warm else ran_warm == 0, ran_warm  # each ready standby served one try

    reports = [xcom("decorated"), xcom("python_op"), xcom("secrets_probe")["where"]]
    ids = {r["sandbox_id"] for r in reports} | {xcom("bash_op")}
    assert len(ids) == 4, reports  # one fresh sandbox per try, each id read inside it
    for report in reports:
        assert report["hostname"] == "sandbox" and "agent.py" in report["pid1"], report

    # The sandbox's environment and files hold none of the scheduler's secrets.
    probe = xcom("secrets_probe")
    haystack = "\n".join([*probe["environ"], *probe["files"].values()])
    assert "AIRFLOW__CORE__EXECUTION_API_SERVER_URL" in haystack  # the search sees the workload's env
    for name in (
        "AIRFLOW__CORE__FERNET_KEY",
        "AIRFLOW__API_AUTH__JWT_SECRET",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
    ):
        assert stack.env[name] not in haystack, name
    assert stack.server.api_key not in haystack
    assert str(stack.db) not in haystack

    # Every sandbox is deleted once the executor has seen its try end (and copied its log out).
    def tries() -> list[str]:  # the pool's idle standbys stay until the scheduler ends
        return [
            sb.id
            for sb in stack.server.client().sandboxes.list()
            if sb.id in ids or STANDBY not in sb.metadata
        ]

    deadline = time.monotonic() + 120
    while tries() and time.monotonic() < deadline:
        time.sleep(1)
    assert tries() == []

    # The failed try: exit code and the last lines of output in its task log, copied out of the sandbox.
    # The executor writes it on the heartbeat after the delete: give the scheduler loop a moment.
    log_dir = stack.home / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}" / "task_id=fails"
    text, deadline = "", time.monotonic() + 60
    while "last words" not in text and time.monotonic() < deadline:
        time.sleep(1)
        text = "\n".join(p.read_text() for p in log_dir.rglob("*.log"))
    assert "last words before failing" in text
    assert "exit code" in text or "returned a non-zero exit code 3" in text

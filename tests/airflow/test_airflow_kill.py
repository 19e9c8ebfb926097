"""A killed task never succeeds and never leaves a sandbox behind (SIGTERM → on_kill; SIGKILL → reaped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pendulum

from tests.airflow.worker_dags import build
from tests.support.dagtest import run_next_try, task_instances

HERE = Path(__file__).parent


def start_worker(dag_id: str, logical_date: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "worker_dags.py"), dag_id, logical_date],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_sandbox(client: Any, task_id: str, proc: subprocess.Popen[str], timeout: float = 90) -> Any:
    """The sandbox the worker created for ``task_id``, once its job is running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "worker exited early:\n" + (proc.stdout.read() if proc.stdout else "")
        for sb in client.sandboxes.list():
            if (sb.metadata or {}).get("job_task") == task_id:
                time.sleep(1.0)  # let the exec start
                return sb
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the worker never created a sandbox")


def test_sigterm_on_kill_fails_the_task_and_deletes_the_sandbox(airflow_env, local_server, ps_client):
    logical_date = pendulum.datetime(2024, 2, 1, tz="UTC").isoformat()
    proc = start_worker("ps_on_kill", logical_date, airflow_env)
    try:
        sandbox = wait_for_sandbox(ps_client, "victim", proc)
        proc.send_signal(signal.SIGTERM)  # what the supervisor sends to a task it stops
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ps_client.sandboxes.list() == [], "on_kill must delete the sandbox"
    from airflow.models.dagrun import DagRun

    dr = DagRun.find(dag_id="ps_on_kill", logical_date=pendulum.parse(logical_date))[0]
    ti = task_instances(dr)[("victim", -1)]
    assert ti.state == "failed", out[-3000:]  # never success (the KPO false-success bug)
    assert ti.try_number == 1  # killed = dead-letter: the retries were not used
    assert "was killed" in out or "cancelled" in out, out[-3000:]
    assert sandbox.id in out


def test_sigkilled_worker_leaves_an_orphan_that_the_next_try_reaps(airflow_env, local_server, ps_client):
    logical_date = pendulum.datetime(2024, 3, 1, tz="UTC")
    proc = start_worker("ps_sigkill", logical_date.isoformat(), airflow_env)
    try:
        orphan = wait_for_sandbox(ps_client, "victim", proc)
        proc.send_signal(signal.SIGKILL)  # a worker lost with no chance to clean up
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The orphan is really there: nobody ran the finally.
    assert [sb.id for sb in ps_client.sandboxes.list()] == [orphan.id]
    assert orphan.metadata["job_try"] == "1"

    # The next try of the same task instance reaps it before creating its own.
    run_id = orphan.metadata["job_run"]
    ti = run_next_try(build("ps_sigkill"), run_id, "victim")
    assert ti.try_number == 2
    assert ti.state == "success"
    assert ps_client.sandboxes.list() == []

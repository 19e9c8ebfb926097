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

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pandastack_local import LocalServer
from pandastack_local.local_server import free_port
from tests.support.airflow_env import api_server_env
from tests.support.dagtest import AIRFLOW_BIN

REPO = Path(__file__).resolve().parents[2]
DAG_FILE = Path(__file__).with_name("executor_dags") / "pandastack_executor_try.py"
DAG_ID = "pandastack_executor_try"


@dataclass
class Stack:
    home: Path
    env: dict[str, str]
    server: LocalServer
    api: str
    procs: dict[str, subprocess.Popen[bytes]]

    @property
    def db(self) -> Path:
        return self.home / "airflow.db"

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=30) as conn:
            return conn.execute(sql, args).fetchall()

    def token(self) -> str:
        with urllib.request.urlopen(f"{self.api}/auth/token", timeout=30) as resp:
            return str(json.loads(resp.read())["access_token"])

    def rest(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(
            f"{self.api}/api/v2{path}",
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={"Authorization": f"Bearer {self.token()}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def log_tail(self, name: str) -> str:
        return (self.home / f"{name}.log").read_text(errors="replace")[-4000:]

    def wait_run(self, run_id: str, timeout: float = 900) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.query("select state from dag_run where dag_id=? and run_id=?", DAG_ID, run_id)
            if rows and rows[0][0] in ("success", "failed"):
                return str(rows[0][0])
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} died:\n{self.log_tail(name)}"
            time.sleep(1)
        raise AssertionError(
            f"run {run_id} did not finish:\n{self.log_tail('scheduler')}\n{self.sandbox_tails()}"
        )

    def sandbox_tails(self) -> str:
        """What the still-running sandboxes printed (diagnostics for a run that hangs)."""
        out = []
        for sb in self.server.client().sandboxes.list():
            res = sb.exec(
                "tail -c 3000 /work/.pandastack/stdout /work/.pandastack/stderr", timeout_seconds=30
            )
            out.append(f"--- {sb.id} {sb.metadata.get('job_task')}:\n{res.stdout}{res.stderr}")
        return "\n".join(out)


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url} did not answer:\n{log.read_text(errors='replace')[-4000:]}")


@pytest.fixture(scope="module")
def stack(airflow_db: Path) -> Iterator[Stack]:
    # Not tmp_path: pytest prunes old base temp dirs, and other pytest sessions on the machine could
    # remove this home (and its SQLite DB) while the scheduler runs.
    home = Path(tempfile.mkdtemp(prefix="ps-executor-airflow-"))
    shutil.copy(airflow_db / "airflow.db", home / "airflow.db")  # migrated once per session
    dags = home / "dags"
    dags.mkdir()
    shutil.copy(DAG_FILE, dags / DAG_FILE.name)
    api_port = free_port()
    template = home / "template"
    template.mkdir()
    (template / "template.json").write_text(
        json.dumps(
            {
                "name": "airflow-worker",
                "python_env": sys.prefix,  # the workers' own environment, read-only
                "code_dirs": [str(dags), str(REPO)],  # the DAG bundle; the editable provider's source
                "memory_mb": 1024,
            }
        )
    )
    server = LocalServer(template_dirs=[str(template)], allow_egress=[f"127.0.0.1:{api_port}"], pool_size=0)
    server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PANDASTACK"))}
    env.update(api_server_env(api_port))
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "airflow_provider.executors.PandaStackExecutor",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            # A loaded CI machine answers slowly: the tasks' API client waits longer (passed in).
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "120",
            "AIRFLOW__CORE__PARALLELISM": "3",
            "AIRFLOW__PANDASTACK_EXECUTOR__TEMPLATE": "airflow-worker",
            "AIRFLOW__PANDASTACK_EXECUTOR__POLL_INTERVAL": "0.5",
            "AIRFLOW__PANDASTACK_EXECUTOR__TIMEOUT": "300",
            "AIRFLOW_CONN_PANDASTACK_DEFAULT": json.dumps(
                {"conn_type": "pandastack", "host": server.url, "password": server.api_key}
            ),
        }
    )
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(home / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen(
                [AIRFLOW_BIN, *args], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        return procs[name]

    try:
        parsed = subprocess.run(
            [AIRFLOW_BIN, "dags", "reserialize"], env=env, capture_output=True, text=True, timeout=300
        )
        assert parsed.returncode == 0, parsed.stderr[-3000:]
        api = start("api-server", "api-server", "--port", str(api_port))
        _wait_http(f"http://127.0.0.1:{api_port}/api/v2/monitor/health", api, home / "api-server.log")
        start("scheduler", "scheduler")
        yield Stack(home, env, server, f"http://127.0.0.1:{api_port}", procs)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for sb in server.client().sandboxes.list():  # only after a failure: the test asserts none
            sb.kill()
        server.close()
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.timeout(1200)
def test_every_try_runs_in_its_own_sandbox_with_no_secrets(stack: Stack) -> None:
    stack.rest("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})
    run_id = f"executor__{time.time_ns()}"
    stack.rest("POST", f"/dags/{DAG_ID}/dagRuns", {"dag_run_id": run_id, "logical_date": None})
    assert stack.wait_run(run_id) == "failed"  # the task "fails" fails on purpose
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
    deadline = time.monotonic() + 120
    while stack.server.client().sandboxes.list() and time.monotonic() < deadline:
        time.sleep(1)
    assert stack.server.client().sandboxes.list() == []

    # The failed try: exit code and the last lines of output in its task log, copied out of the sandbox.
    # The executor writes it on the heartbeat after the delete: give the scheduler loop a moment.
    log_dir = stack.home / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}" / "task_id=fails"
    text, deadline = "", time.monotonic() + 60
    while "last words" not in text and time.monotonic() < deadline:
        time.sleep(1)
        text = "\n".join(p.read_text() for p in log_dir.rglob("*.log"))
    assert "last words before failing" in text
    assert "exit code" in text or "returned a non-zero exit code 3" in text

"""A scheduler with ``PandaStackExecutor`` on SQLite, for the scheduler test and the benchmark.

pandastack-local with a template that binds this environment (read-only) and the DAG code,
and an egress allow-list with exactly the api-server's port; ``airflow api-server`` (the
Execution API the tasks call) and ``airflow scheduler``, each with its log in the home.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pandastack_local import LocalServer
from pandastack_local.harness import free_port
from pandastack_local.testing.airflow_env import api_server_env

AIRFLOW_BIN = str(Path(sys.executable).with_name("airflow"))
TEMPLATE = "airflow-worker"


def worker_template(directory: Path, code_dirs: list[str], name: str = TEMPLATE) -> Path:
    """A template of the workers' own environment (read-only) and ``code_dirs`` (DAGs, source)."""
    directory.mkdir(parents=True, exist_ok=True)
    spec = {"name": name, "python_env": sys.prefix, "code_dirs": code_dirs, "memory_mb": 1024}
    (directory / "template.json").write_text(json.dumps(spec))
    return directory


@dataclass
class ExecutorStack:
    home: Path
    env: dict[str, str]
    server: LocalServer
    api: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

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

    def trigger(self, dag_id: str) -> str:
        self.rest("PATCH", f"/dags/{dag_id}", {"is_paused": False})
        run_id = f"{dag_id}__{time.time_ns()}"
        self.rest("POST", f"/dags/{dag_id}/dagRuns", {"dag_run_id": run_id, "logical_date": None})
        return run_id

    def log_tail(self, name: str) -> str:
        return (self.home / f"{name}.log").read_text(errors="replace")[-4000:]

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 900) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.query("select state from dag_run where dag_id=? and run_id=?", dag_id, run_id)
            if rows and rows[0][0] in ("success", "failed"):
                return str(rows[0][0])
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} died:\n{self.log_tail(name)}"
            time.sleep(1)
        raise AssertionError(f"run {run_id} did not finish:\n{self.log_tail('scheduler')}")

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(self.home / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [AIRFLOW_BIN, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        return self.procs[name]

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def scheduler_home(migrated_db: Path, dag_file: Path, prefix: str) -> tuple[Path, Path]:
    """A fresh AIRFLOW_HOME with a copy of a migrated metadata DB and ``dag_file`` in its dags
    folder: ``(home, dags)``.

    Not under pytest's tmp_path: pytest prunes old base temp dirs, and other pytest sessions on the
    machine could remove this home (and its SQLite DB) while the scheduler runs. Copied through
    SQLite's backup API, never by opening the file: a plain open and close by this process drops
    every POSIX lock its live SQLite connections hold on it, so the next worker to close thinks it
    is the last and deletes the WAL under a SIGKILLed worker's later commits.
    """
    home = Path(tempfile.mkdtemp(prefix=prefix))
    live, copy = sqlite3.connect(migrated_db), sqlite3.connect(home / "airflow.db")
    with contextlib.closing(live), contextlib.closing(copy):
        live.backup(copy)
    dags = home / "dags"
    dags.mkdir()
    shutil.copy(dag_file, dags / dag_file.name)
    return home, dags


def start_executor_stack(
    home: Path,
    dags: Path,
    code_dirs: list[str],
    executor: str,
    extra_env: dict[str, str],
    pool_size: int | None = None,
) -> ExecutorStack:
    """Server, api-server and scheduler on the migrated SQLite DB in ``home`` (the caller stops them:
    ``stack.stop()`` then ``stack.server.close()``)."""
    api_port = free_port()
    template = worker_template(home / "template", code_dirs)
    server = LocalServer(
        template_dirs=[str(template)], allow_egress=[f"127.0.0.1:{api_port}"], pool_size=pool_size
    )
    server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PANDASTACK"))}
    env.update(api_server_env(api_port))
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": executor,
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            # A loaded machine answers slowly: the tasks' API client waits longer (passed in).
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "120",
            "AIRFLOW__PANDASTACK_EXECUTOR__TEMPLATE": TEMPLATE,
            "AIRFLOW__PANDASTACK_EXECUTOR__POLL_INTERVAL": "0.5",
            "AIRFLOW_CONN_PANDASTACK_DEFAULT": json.dumps(
                {"conn_type": "pandastack", "host": server.url, "password": server.api_key}
            ),
            **extra_env,
        }
    )
    stack = ExecutorStack(home, env, server, f"http://127.0.0.1:{api_port}")
    try:
        for args in (("db", "migrate"), ("dags", "reserialize")):
            done = subprocess.run([AIRFLOW_BIN, *args], env=env, capture_output=True, text=True, timeout=400)
            assert done.returncode == 0, f"airflow {' '.join(args)}: {done.stderr[-3000:]}"
        api = stack.start("api-server", "api-server", "--port", str(api_port))
        _wait_http(f"{stack.api}/api/v2/monitor/health", api, home / "api-server.log")
        stack.start("scheduler", "scheduler")
    except BaseException:
        stack.stop()
        server.close()
        raise
    return stack


def pandastack_executor_stack(
    home: Path, dags: Path, repo: Path, warm_pool_size: str, extra_env: dict[str, str] | None = None
) -> ExecutorStack:
    """The stack with PandaStackExecutor (a 300 s try timeout, no server pool): the DAG bundle and
    ``repo``'s provider bound into each sandbox, ``repo`` first on the tries' PYTHONPATH (in the
    section's env, so a standby's runner imports under it too), wherever an editable install points."""
    env = {
        "AIRFLOW__PANDASTACK_EXECUTOR__TIMEOUT": "300",
        "AIRFLOW__PANDASTACK_EXECUTOR__WARM_POOL_SIZE": warm_pool_size,
        "AIRFLOW__PANDASTACK_EXECUTOR__ENV": json.dumps({"PYTHONPATH": str(repo)}),
        **(extra_env or {}),
    }
    code_dirs = [str(dags), str(repo)]
    return start_executor_stack(
        home, dags, code_dirs, "airflow_provider.executors.PandaStackExecutor", env, pool_size=0
    )


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

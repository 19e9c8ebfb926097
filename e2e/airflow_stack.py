"""Airflow 3.3 in the production shape: PostgreSQL metadata DB, CeleryExecutor on Redis,
api-server, scheduler, dag-processor, triggerer and two Celery workers, each its own process.

Configuration is environment only (``AIRFLOW__…`` variables), the PandaStack
connection comes from the environment secrets backend (``AIRFLOW_CONN_PANDASTACK_DEFAULT``),
and DAGs come from two local bundles: the repository's ``dags/`` and ``e2e/dags/``.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pandastack_local.testing.airflow_env import api_server_env
from pandastack_local.testing.waiting import wait_for

from .procs import Proc, ProcessGroup, free_port, run
from .services import REPO, PandaStack, Postgres, Redis, request_json

AF_BIN = REPO / ".venv-airflow" / "bin"
WORKERS = ("worker-a", "worker-b")
TERMINAL = {"success", "failed"}


def airflow_env(run_dir: Path, pg: Postgres, redis: Redis, ps: PandaStack, api_port: int) -> dict[str, str]:
    home = run_dir / "airflow"
    home.mkdir(exist_ok=True)
    bundles = [
        {
            "name": "examples",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(REPO / "dags"), "refresh_interval": 5},
        },
        {
            "name": "e2e",
            "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
            "kwargs": {"path": str(REPO / "e2e" / "dags"), "refresh_interval": 5},
        },
    ]
    conn = {"conn_type": "pandastack", "host": ps.url, "password": ps.api_key}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PANDASTACK"))}
    env.update(api_server_env(api_port))
    env.update(
        {
            "PATH": f"{AF_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": "e2e.hostname.get",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": pg.url("airflow"),
            "AIRFLOW__CELERY__BROKER_URL": redis.url,
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + pg.url("airflow"),
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": "4",
            "AIRFLOW__CELERY__WORKER_PREFETCH_MULTIPLIER": "1",
            "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps(bundles),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "10",
            # A dead worker's task is noticed in ~30 s, not the default 5 min.
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_SEC": "5",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
            "AIRFLOW__TRIGGERER__CAPACITY": "100",
            "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "21600",
            # The PandaStack connection, from the environment-variable secrets backend.
            "AIRFLOW_CONN_PANDASTACK_DEFAULT": json.dumps(conn),
            "E2E_PANDASTACK_URL": ps.url,
        }
    )
    return env


@dataclass
class AirflowStack:
    group: ProcessGroup
    env: dict[str, str]
    api_port: int
    _token: str | None = None
    workers: dict[str, Proc] = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    # -- REST (public API v2, JWT from the simple auth manager) ---------------------------------

    def token(self) -> str:
        if self._token is None:
            with urllib.request.urlopen(f"{self.api}/auth/token", timeout=15) as resp:  # noqa: S310
                self._token = json.loads(resp.read())["access_token"]
        return self._token

    def request(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        auth = {"Authorization": f"Bearer {self.token()}"}
        return request_json(method, f"{self.api}/api/v2{path}", body, auth, timeout)

    def wait_dag(self, dag_id: str, timeout: float = 180) -> dict[str, Any]:
        """Wait until the dag-processor has parsed ``dag_id`` (and report import errors if not)."""

        def import_errors() -> str:
            try:
                errs = self.request("GET", "/importErrors")
                return json.dumps(errs.get("import_errors", []))[:4000]
            except AssertionError as exc:
                return str(exc)

        return wait_for(
            f"DAG {dag_id} to be parsed",
            lambda: self.request("GET", f"/dags/{dag_id}"),
            timeout=timeout,
            interval=0.5,
            on_timeout=lambda: "import errors: " + import_errors(),
        )

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        self.request("PATCH", f"/dags/{dag_id}", {"is_paused": False})
        run_id = f"e2e__{dag_id}__{time.time_ns()}"
        body = {"dag_run_id": run_id, "logical_date": None, "conf": conf or {}}
        return self.request("POST", f"/dags/{dag_id}/dagRuns", body)["dag_run_id"]

    def dag_run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return self.request("GET", f"/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id)}")

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 300) -> dict[str, Any]:
        return wait_for(
            f"DAG run {dag_id}/{run_id} to finish",
            lambda: self.dag_run(dag_id, run_id),
            timeout=timeout,
            interval=0.5,
            check=lambda r: r["state"] in TERMINAL,
            on_timeout=lambda: json.dumps(self.task_instances(dag_id, run_id))[:4000],
        )

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        path = f"/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id)}/taskInstances?limit=1000"
        return self.request("GET", path)["task_instances"]

    def task_instance(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> dict[str, Any]:
        path = f"/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id)}/taskInstances/{task_id}"
        if map_index >= 0:
            path += f"/{map_index}"
        return self.request("GET", path)

    def tries(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> list[dict[str, Any]]:
        path = f"/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id)}/taskInstances/{task_id}"
        if map_index >= 0:
            path += f"/{map_index}"
        return self.request("GET", path + "/tries")["task_instances"]

    def xcom(
        self, dag_id: str, run_id: str, task_id: str, key: str = "return_value", map_index: int = -1
    ) -> Any:
        path = (
            f"/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id)}/taskInstances/{task_id}"
            f"/xcomEntries/{key}?map_index={map_index}&deserialize=true"
        )
        return self.request("GET", path)["value"]

    def xcom_entries(self, dag_id: str, run_id: str, task_id: str) -> list[dict[str, Any]]:
        path = (
            f"/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id)}/taskInstances/{task_id}"
            "/xcomEntries?limit=1000"
        )
        return self.request("GET", path)["xcom_entries"]

    def ensure_pool(self, name: str, slots: int) -> None:
        try:
            self.request("GET", f"/pools/{name}")
            self.request("PATCH", f"/pools/{name}", {"name": name, "slots": slots})
        except AssertionError:
            self.request("POST", "/pools", {"name": name, "slots": slots})

    # -- processes ------------------------------------------------------------------------------

    def start_worker(self, name: str) -> Proc:
        proc = self.group.start(
            f"airflow-{name}",
            [
                str(AF_BIN / "airflow"),
                "celery",
                "worker",
                "--skip-serve-logs",
                "--concurrency",
                "4",
                "--celery-hostname",
                f"{name}@%h",
                "--without-gossip",
                "--without-mingle",
            ],
            env={**self.env, "E2E_WORKER_NAME": name},
        )
        self.workers[name] = proc
        return proc


def start_airflow(group: ProcessGroup, pg: Postgres, redis: Redis, ps: PandaStack) -> AirflowStack:
    pg.create_db("airflow")
    api_port = free_port()
    env = airflow_env(group.run_dir, pg, redis, ps, api_port)
    run(
        [str(AF_BIN / "airflow"), "db", "migrate"], env=env, timeout=400, log=group.log_dir / "airflow-db.log"
    )
    stack = AirflowStack(group, env, api_port)
    airflow = str(AF_BIN / "airflow")
    group.start(
        "airflow-api-server",
        [airflow, "api-server", "--host", "127.0.0.1", "--port", str(api_port), "--workers", "1"],
        env=env,
        ports=[api_port],
    )
    group.start("airflow-scheduler", [airflow, "scheduler"], env=env)
    group.start("airflow-dag-processor", [airflow, "dag-processor"], env=env)
    group.start("airflow-triggerer", [airflow, "triggerer", "--skip-serve-logs"], env=env)
    for name in WORKERS:
        stack.start_worker(name)
    airflow_procs = [p for p in group.procs if p.name.startswith("airflow-")]
    abort = lambda: next((f"{p.name} exited" for p in airflow_procs if not p.alive()), None)  # noqa: E731
    wait_for(
        "the Airflow API server",
        stack.token,
        timeout=180,
        interval=0.5,
        abort=abort,
        on_timeout=lambda: group.get("airflow-api-server").tail(),
    )
    wait_for(
        "two Celery workers to be up",
        lambda: _celery_ping(env),
        timeout=180,
        interval=3,
        abort=abort,
        check=lambda names: all(any(n.startswith(w + "@") for n in names) for w in WORKERS),
        on_timeout=lambda: "\n".join(group.get(f"airflow-{w}").tail(30) for w in WORKERS),
    )
    return stack


def _celery_ping(env: dict[str, str]) -> list[str]:
    out = run([str(AF_BIN / "python"), "-m", "e2e.celery_ping"], env=env, timeout=60)
    return json.loads(out.strip().splitlines()[-1])

"""Prefect 3.9 in the production shape: a server on PostgreSQL, a ``process`` work pool,
two workers (each its own process tree), deployments pulled from local source.

Everything Prefect-side runs in the Prefect venv (Airflow and Prefect cannot share
one); this module only starts processes and talks to the REST API.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pandastack_local.testing.waiting import wait_for

from .procs import Proc, ProcessGroup, free_port, run
from .services import REPO, PandaStack, Postgres, request_json

PF_BIN = REPO / ".venv-prefect" / "bin"
POOL = "e2e-process-pool"
WORKERS = ("worker-a", "worker-b")
BLOCK_NAME = "e2e-local"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


def prefect_env(run_dir: Path, pg: Postgres, ps: PandaStack, port: int) -> dict[str, str]:
    home = run_dir / "prefect"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT", "PANDASTACK", "AIRFLOW"))}
    env.update(
        {
            "PATH": f"{PF_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
            "PYTHONPATH": f"{REPO}:{REPO / 'flows'}",
            "PYTHONUNBUFFERED": "1",
            "PREFECT_HOME": str(home),
            "PREFECT_PROFILES_PATH": str(home / "profiles.toml"),
            "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(port),
            "PREFECT_API_DATABASE_CONNECTION_URL": pg.url("prefect", driver="asyncpg"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            # The UI is served too: e2e/ui_checks.py looks at the block and artifact pages.
            "PREFECT_UI_ENABLED": "true",
            "PREFECT_SERVER_UI_ENABLED": "true",
            "PREFECT_LOGGING_LEVEL": "INFO",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_WORKER_PREFETCH_SECONDS": "2",
            "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
            "PREFECT_LOCAL_STORAGE_PATH": str(home / "results"),
            "PREFECT_INTEGRATIONS_PANDASTACK_RETRY_BASE_SECONDS": "1",
            "PREFECT_INTEGRATIONS_PANDASTACK_FILES_DIR": str(home / "files"),
            "E2E_PANDASTACK_BLOCK": BLOCK_NAME,
            # The example flows use the credentials' environment fallback; the e2e flow loads the block.
            **ps.env(),
        }
    )
    return env


@dataclass
class PrefectStack:
    group: ProcessGroup
    env: dict[str, str]
    port: int
    workers: dict[str, Proc] = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        return request_json(method, f"{self.api}{path}", body, timeout=timeout)

    def python(self, *args: str, timeout: float = 180) -> str:
        return run(
            [str(PF_BIN / "python"), *args],
            env=self.env,
            cwd=REPO,
            timeout=timeout,
            log=self.group.log_dir / "prefect-cli.log",
        )

    def deployment_id(self, flow_name: str, deployment: str) -> str:
        return self.request("GET", f"/deployments/name/{flow_name}/{deployment}")["id"]

    def run_deployment(
        self, flow_name: str, deployment: str, parameters: dict[str, Any] | None = None
    ) -> str:
        dep = self.deployment_id(flow_name, deployment)
        fr = self.request(
            "POST",
            f"/deployments/{dep}/create_flow_run",
            {"parameters": parameters or {}, "state": {"type": "SCHEDULED"}},
        )
        return fr["id"]

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        return self.request("GET", f"/flow_runs/{flow_run_id}")

    def wait_flow_run(
        self, flow_run_id: str, timeout: float = 300, states: set[str] = FINAL
    ) -> dict[str, Any]:
        return wait_for(
            f"flow run {flow_run_id} to reach {sorted(states)}",
            lambda: self.flow_run(flow_run_id),
            timeout=timeout,
            interval=0.5,
            check=lambda fr: (fr.get("state_type") or "") in states,
            on_timeout=lambda: json.dumps(self.flow_run(flow_run_id).get("state"))[:2000],
        )

    def task_runs(self, flow_run_id: str) -> list[dict[str, Any]]:
        return self.request(
            "POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200}
        )

    def set_state(
        self, flow_run_id: str, state_type: str, name: str | None = None, force: bool = True
    ) -> dict[str, Any]:
        state: dict[str, Any] = {"type": state_type}
        if name:
            state["name"] = name
        return self.request("POST", f"/flow_runs/{flow_run_id}/set_state", {"state": state, "force": force})

    def result(self, flow_run_id: str) -> Any:
        """The flow run's return value, read back through the Prefect client (in the Prefect venv)."""
        out = self.python("-m", "e2e.prefect_result", flow_run_id, timeout=120)
        return json.loads(out.strip().splitlines()[-1])

    def artifacts(self, flow_run_id: str) -> list[dict[str, Any]]:
        return self.request(
            "POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200}
        )

    def start_worker(self, name: str, pool: str = POOL, worker_type: str = "process") -> Proc:
        proc = self.group.start(
            f"prefect-{name}",
            [
                str(PF_BIN / "prefect"),
                "worker",
                "start",
                "--pool",
                pool,
                "--name",
                name,
                "--type",
                worker_type,
                "--limit",
                "4",
            ],
            env={**self.env, "E2E_WORKER_NAME": name},
            cwd=REPO,
        )
        self.workers[name] = proc
        return proc

    def online_workers(self, pool: str = POOL) -> list[str]:
        rows = self.request("POST", f"/work_pools/{pool}/workers/filter", {})
        return sorted(w["name"] for w in rows if w.get("status") == "ONLINE")


S = TypeVar("S", bound=PrefectStack)


def start_server(stack: S, name: str, *extra: str) -> S:
    """``prefect server start`` for ``stack`` (its env, its port, ``extra`` flags), until healthy."""
    stack.group.start(
        name,
        [
            str(PF_BIN / "prefect"),
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(stack.port),
            *extra,
        ],
        env=stack.env,
        cwd=REPO,
        ports=[stack.port],
    )
    wait_for(
        f"the Prefect server {name}",
        lambda: stack.request("GET", "/health"),
        timeout=180,
        interval=0.5,
        check=lambda v: v is True or v == "true" or v is not None,
        on_timeout=lambda: stack.group.get(name).tail(),
    )
    return stack


def start_prefect(group: ProcessGroup, pg: Postgres, ps: PandaStack) -> PrefectStack:
    pg.create_db("prefect")
    port = free_port()
    env = prefect_env(group.run_dir, pg, ps, port)
    stack = start_server(PrefectStack(group, env, port), "prefect-server")
    # The credentials block, saved on the server; the work pool; the deployments.
    stack.python(
        "-m",
        "e2e.prefect_setup",
        "--pool",
        POOL,
        "--block",
        BLOCK_NAME,
        "--api-url",
        ps.url,
        "--api-key",
        ps.api_key,
        timeout=300,
    )
    for name in WORKERS:
        stack.start_worker(name)
    wait_for(
        "two Prefect workers online",
        stack.online_workers,
        timeout=120,
        interval=0.5,
        check=lambda names: set(WORKERS) <= set(names),
        on_timeout=lambda: "\n".join(group.get(f"prefect-{w}").tail(30) for w in WORKERS),
    )
    return stack

"""Run the example DAGs with ``airflow dags test`` (SQLite), as a user would. Airflow environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .expectations import Row

ROOT = Path(__file__).resolve().parent.parent
DAGS = ("pandastack_scheduled_report", "pandastack_tenant_transforms", "pandastack_warm_fork_batch")
POOL = "pandastack_sandboxes"


def airflow_env(home: Path, server_url: str, api_key: str, reports_url: str) -> dict[str, str]:
    """The environment of every ``airflow`` command of the demo (and of the example tests)."""
    env = dict(os.environ)
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW_CONN_PANDASTACK_DEFAULT": json.dumps(
                {"conn_type": "pandastack", "host": server_url, "password": api_key}
            ),
            "PANDASTACK_REPORTS_URL": reports_url,
        }
    )
    return env


def _airflow(*args: str, env: dict[str, str], log: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [str(Path(sys.executable).parent / "airflow"), *args]
    if log is None:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    with log.open("w") as fh:
        return subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True, check=False)


def prepare(env: dict[str, str]) -> None:
    """Create the metadata DB and the pool that bounds live sandboxes."""
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    for args in (("db", "migrate"), ("pools", "set", POOL, "4", "live PandaStack sandboxes")):
        done = _airflow(*args, env=env)
        if done.returncode != 0:
            raise RuntimeError(
                f"airflow {' '.join(args)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )


def run_dag(dag_id: str, env: dict[str, str], log: Path) -> list[Row]:
    """``airflow dags test DAG_ID`` then one row per task instance of that run."""
    _airflow("dags", "test", dag_id, env=env, log=log)
    summary = subprocess.run(
        [sys.executable, "-m", "demo.airflow_summary", dag_id],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    if summary.returncode != 0:
        raise RuntimeError(f"could not read the run of {dag_id}:\n{summary.stderr[-3000:]}")
    rows: list[Row] = json.loads(summary.stdout.strip().splitlines()[-1])
    return rows

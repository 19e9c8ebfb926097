"""DAGs run in a separate worker process, so a test can SIGTERM or SIGKILL it mid-job.

Usage: ``python worker_dags.py <dag_id> <logical_date ISO>`` (Airflow env from the caller).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider.operators.sandbox import PandaStackSandboxOperator

START = pendulum.datetime(2024, 1, 1, tz="UTC")
# The first try sleeps (long enough to be killed); later tries finish at once.
SLEEP_ON_FIRST_TRY = (
    "{% if ti.try_number == 1 %}echo started; sleep 60; {% endif %}"
    "echo '{\"try\": {{ ti.try_number }}}' > result.json"
)


def build(dag_id: str) -> DAG:
    with DAG(dag_id, schedule=None, start_date=START) as dag:
        PandaStackSandboxOperator(
            task_id="victim",
            command=SLEEP_ON_FIRST_TRY,
            timeout=120,
            retries=2,
            retry_delay=timedelta(seconds=0),
        )
    return dag


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: tests.support
    from tests.support.dagtest import run_dag

    dag_id, logical_date = sys.argv[1], pendulum.parse(sys.argv[2])
    dr = run_dag(build(dag_id), logical_date=logical_date, run_after=logical_date)
    print("DAGRUN-STATE", dr.state, flush=True)

"""E2E-only DAGs (not examples): a slow sandbox job for the worker-kill scenario and a
deferrable one for the triggerer. Loaded from the ``e2e`` DAG bundle by ``make test-e2e``."""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, task

from airflow_provider.operators.sandbox import PandaStackSandboxOperator
from e2e.jobcode import SLOW_JOB

with DAG("e2e_worker_kill", schedule=None, catchup=False, tags=["e2e"], max_active_runs=1):
    slow = PandaStackSandboxOperator(
        task_id="slow_job",
        command="python3 job.py",
        files={"job.py": SLOW_JOB},
        input={"seconds": 20, "value": 21},
        timeout=120,
        retries=2,
        retry_delay=timedelta(seconds=2),
    )

    @task
    def consume(result: dict) -> dict:
        print(f"e2e consumed {result}")
        return result

    consume(slow.output)

with DAG("e2e_deferrable", schedule=None, catchup=False, tags=["e2e"]):
    PandaStackSandboxOperator(
        task_id="deferred_job",
        command="python3 job.py",
        files={"job.py": SLOW_JOB},
        input={"seconds": 8, "value": 50},
        timeout=120,
        deferrable=True,
        poll_interval=1.0,
    )

"""E2E-only DAG (not an example): PandaStackQueueOperator on a real Redis stream, run by the real
scheduler on a Celery worker. The stream comes with the run (``conf["broker"]``), so each test
uses a fresh one; ``make test-e2e`` triggers it through the REST API (e2e/test_airflow_celery.py).

``release_delay`` (6 s) is longer than ``idle_seconds`` (2 s): a message released by one run is
not redelivered within it, so the next run gets it, as a scheduled queue-worker DAG would.
"""

from __future__ import annotations

from airflow.sdk import DAG

from airflow_provider.operators.queue import PandaStackQueueOperator

with DAG("e2e_queue", schedule=None, catchup=False, tags=["e2e", "queue"], max_active_runs=1):
    PandaStackQueueOperator(
        task_id="consume",
        broker="{{ dag_run.conf['broker'] }}",
        concurrency=3,
        max_messages=20,
        idle_seconds=2,
        lease_seconds=10,
        max_deliveries=3,
        release_delay=6,
        defaults={"template": "base", "timeout": 60},  # e2e/queue_checks.py DEFAULTS
    )

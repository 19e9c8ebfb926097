"""E2E-only DAGs (not examples): PandaStackQueueOperator on a real broker, run by the real
scheduler on a Celery worker. The broker URL comes with the run (``conf["broker"]``), so each test
uses a fresh stream or topic; ``make test-e2e`` triggers them through the REST API
(e2e/test_airflow_celery.py).

- ``e2e_queue`` (a Redis stream): ``release_delay`` (6 s) is longer than ``idle_seconds`` (2 s),
  so a message released by one run is not redelivered within it: the next run gets it, as a
  scheduled queue-worker DAG would.
- ``e2e_queue_kafka`` (an Apache Kafka topic): one run sees both deliveries of a failing message:
  ``release_delay`` (1 s) is shorter than ``idle_seconds`` (15 s), so the retry topic hands it back
  within the run, and ``max_messages=2`` ends the run once that second delivery is settled.
"""

from __future__ import annotations

from airflow.sdk import DAG

from airflow_provider.operators.queue import PandaStackQueueOperator

RUNS = {
    "e2e_queue": {
        "concurrency": 3,
        "max_messages": 20,
        "idle_seconds": 2,
        "lease_seconds": 10,
        "release_delay": 6,
    },
    "e2e_queue_kafka": {"concurrency": 1, "max_messages": 2, "idle_seconds": 15, "release_delay": 1},
}

for dag_id, options in RUNS.items():
    with DAG(dag_id, schedule=None, catchup=False, tags=["e2e", "queue"], max_active_runs=1):
        PandaStackQueueOperator(
            task_id="consume",
            broker="{{ dag_run.conf['broker'] }}",
            max_deliveries=3,
            defaults={"template": "base", "timeout": 60},  # e2e/queue_checks.py DEFAULTS
            **options,
        )

"""E2E-only DAG (not an example): PandaStackQueueOperator on a real Apache Kafka topic, run by the
real scheduler on a Celery worker. The topic comes with the run (``conf["broker"]``);
``make test-e2e`` triggers it through the REST API (e2e/test_airflow_celery.py).

Unlike ``e2e_queue`` (Redis), one run sees both deliveries of a failing message: ``release_delay``
(1 s) is shorter than ``idle_seconds`` (15 s), so the retry topic hands the message back within
the run, and ``max_messages=2`` ends the run once that second delivery is settled.
"""

from __future__ import annotations

from airflow.sdk import DAG

from airflow_provider.operators.queue import PandaStackQueueOperator

with DAG("e2e_queue_kafka", schedule=None, catchup=False, tags=["e2e", "queue"], max_active_runs=1):
    PandaStackQueueOperator(
        task_id="consume",
        broker="{{ dag_run.conf['broker'] }}",
        concurrency=1,
        max_messages=2,
        idle_seconds=15,
        max_deliveries=3,
        release_delay=1,
        defaults={"template": "base", "timeout": 60},  # e2e/queue_checks.py DEFAULTS
    )

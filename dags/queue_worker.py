"""Queue worker: every few minutes, drain a batch of messages from a broker, one sandbox each.

Each message (docs/queues.md, ``pandastack-job/1``) runs in its own throwaway
sandbox; it stays leased on the broker until its result is on the reply
destination, then it is acked. A failure that may pass on a retry goes back to
the broker for redelivery, one that cannot pass to the broker's dead-letter
destination with the reason. Set ``PANDASTACK_QUEUE_BROKER`` (e.g.
``redis://redis:6379/0?stream=jobs``, ``postgresql://...?queue=jobs``,
``amqp://...?queue=jobs``, ``sqs://jobs?region=eu-west-1``).
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import DAG

from airflow_provider.operators.queue import PandaStackQueueOperator

BROKER = os.environ.get("PANDASTACK_QUEUE_BROKER", "redis://127.0.0.1:6379/0?stream=pandastack-jobs")

with DAG(
    dag_id="pandastack_queue_worker",
    schedule="*/5 * * * *",
    start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,  # one batch at a time; scale with --concurrency, or with more consumers
    tags=["pandastack", "example", "queue"],
    doc_md=__doc__,
) as dag:
    PandaStackQueueOperator(
        task_id="consume",
        broker=BROKER,
        concurrency=4,
        max_messages=200,
        idle_seconds=10,
        defaults={"template": "code-interpreter", "timeout": 120},
        retries=2,  # for an unreachable broker; message failures are the broker's to redeliver
    )

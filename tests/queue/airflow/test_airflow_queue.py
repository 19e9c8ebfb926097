"""PandaStackQueueOperator in a real DAG run (``dag.test()``) on the real brokers of tests/queue."""

from __future__ import annotations

import json

import pendulum
from airflow.sdk import DAG

from airflow_provider.operators.queue import PandaStackQueueOperator
from e2e.procs import free_port
from tests.queue.batch import CONSUME, RESULTS, results, send_batch
from tests.queue.brokers import Broker
from tests.support.dagtest import run_dag, task_instances, xcom

START = pendulum.datetime(2024, 1, 1, tz="UTC")


def test_a_batch_acks_after_results_redelivers_and_dead_letters(
    airflow_env,
    local_server,
    broker: Broker,
    queue,
):
    send_batch(broker, queue, b"{not json")
    with DAG(f"ps_queue_{broker.name}", schedule=None, start_date=START) as dag:
        PandaStackQueueOperator(task_id="consume", broker=broker.url(queue), **CONSUME)
    dr = run_dag(dag)
    assert task_instances(dr)[("consume", -1)].state == "success"
    summary = xcom(dr, "consume")
    assert summary["acked"] == 2 and summary["redelivered"] == 1 and summary["dead_lettered"] == 2, summary
    assert results(broker, queue) == RESULTS
    kinds = sorted(d["why"]["kind"] for d in broker.dead(queue))
    assert kinds == ["malformed", "permanent_exit_code"]
    assert (
        json.loads(next(d["body"] for d in broker.dead(queue) if d["why"]["kind"] != "malformed"))["id"]
        == "poison"
    )
    assert broker.depth(queue) == 0
    assert local_server.client().sandboxes.list() == []


def test_an_unreachable_broker_fails_the_task(airflow_env):
    with DAG("ps_queue_unreachable", schedule=None, start_date=START) as dag:
        PandaStackQueueOperator(task_id="consume", broker=f"redis://127.0.0.1:{free_port()}/0?stream=x")
    dr = run_dag(dag)
    assert task_instances(dr)[("consume", -1)].state == "failed"

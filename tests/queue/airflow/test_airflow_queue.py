"""PandaStackQueueOperator in a real DAG run (``dag.test()``) on the real brokers of tests/queue."""

from __future__ import annotations

import json

import pendulum
from airflow.sdk import DAG

from airflow_provider.operators.queue import PandaStackQueueOperator
from e2e.procs import free_port
from tests.queue.brokers import Broker
from tests.queue.conftest import echo_job, message
from tests.support.dagtest import run_dag, task_instances, xcom

START = pendulum.datetime(2024, 1, 1, tz="UTC")


def test_a_batch_acks_after_results_redelivers_and_dead_letters(
    airflow_env,
    local_server,
    broker: Broker,
    queue,
):
    t = broker.transport(queue)
    t.send(message(echo_job(), id="good"))
    t.send(message(f'[ "$QUEUE_DELIVERY" -ge 2 ] || exit 1; {echo_job()}', id="flaky"))
    t.send(message("exit 4", id="poison", permanent_exit_codes=[4]))
    t.send(b"{not json")
    t.close()
    with DAG(f"ps_queue_{broker.name}", schedule=None, start_date=START) as dag:
        PandaStackQueueOperator(
            task_id="consume",
            broker=broker.url(queue),
            concurrency=2,
            max_messages=10,
            idle_seconds=2,
            lease_seconds=5,
            release_delay=0.2,
            defaults={"template": "base", "timeout": 30},
        )
    dr = run_dag(dag)
    assert task_instances(dr)[("consume", -1)].state == "success"
    summary = xcom(dr, "consume")
    assert summary["acked"] == 2 and summary["redelivered"] == 1 and summary["dead_lettered"] == 2, summary
    results = {r["id"]: r["result"] for r in broker.results(queue)}
    assert results == {"good": {"id": "good", "delivery": 1}, "flaky": {"id": "flaky", "delivery": 2}}
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

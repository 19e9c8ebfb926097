"""PandaStackQueueOperator in a real DAG run (``dag.test()``) on the real brokers of tests/queue."""

from __future__ import annotations

import json
from typing import Any

import pendulum
import pytest
from airflow.sdk import DAG

from airflow_provider.operators.queue import PandaStackQueueOperator
from e2e.brokers import Broker
from e2e.procs import free_port
from pandastack_jobs.queue import CONSUMER_DEFAULTS
from tests.queue import batch  # the batch every engine consumes (batch.CONSUME, batch.RESULTS, ...)
from tests.queue.batch import check_chunk_results, results, send_batch, send_chunk_batch
from tests.support.dagtest import run_dag, task_instances, xcom

START = pendulum.datetime(2024, 1, 1, tz="UTC")


def consumed(dag_id: str, broker_url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Run a DAG of one PandaStackQueueOperator on ``broker_url``; it succeeds; its summary (xcom)."""
    with DAG(dag_id, schedule=None, start_date=START) as dag:
        PandaStackQueueOperator(task_id="consume", broker=broker_url, **options)
    dr = run_dag(dag)
    assert task_instances(dr)[("consume", -1)].state == "success"
    return xcom(dr, "consume")


def test_a_batch_acks_after_results_redelivers_and_dead_letters(
    airflow_env,
    local_server,
    broker: Broker,
    queue,
):
    send_batch(broker, queue, b"{not json")
    summary = consumed(f"ps_queue_{broker.name}", broker.url(queue), batch.CONSUME)
    assert summary["acked"] == 2 and summary["redelivered"] == 1 and summary["dead_lettered"] == 2, summary
    assert results(broker, queue) == batch.RESULTS
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


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_chunks_share_a_sandbox_per_key_and_ack_each_mate(airflow_env, local_server, broker: Broker, queue):
    """``chunk_size=4, chunk_key="input.customer", chunk_keyless=True``: one customer's messages
    share a sandbox, each acked on its own; a mate that fails is redelivered alone and acked; the
    keyless ones share one; no sandbox is left."""
    send_chunk_batch(broker, queue)
    summary = consumed(f"ps_queue_chunks_{broker.name}", broker.url(queue), batch.CHUNK_CONSUME)
    assert summary["acked"] == 6 and summary["redelivered"] == 1 and summary["dead_lettered"] == 0, summary
    check_chunk_results(broker, queue)
    assert local_server.client().sandboxes.list() == []


def test_the_chunk_settings_default_to_the_cores_and_are_checked_at_parse(airflow_env):
    """No chunk options: the core's defaults (one sandbox per message); a chunk size that could
    not release a dead chunk's mates, or an unknown key, fails where the DAG declares it."""
    op = PandaStackQueueOperator(task_id="c", broker="redis://127.0.0.1:1/0?stream=x")
    assert (
        (op.chunk_size, op.chunk_key, op.chunk_keyless)
        == (
            CONSUMER_DEFAULTS.chunk_size,
            CONSUMER_DEFAULTS.chunk_key,
            CONSUMER_DEFAULTS.chunk_keyless,
        )
        == (1, "tenant", False)
    )
    with pytest.raises(ValueError, match="chunk_size > 1 needs max_deliveries >= 2"):
        PandaStackQueueOperator(task_id="d", broker="redis://x", chunk_size=2, max_deliveries=1)
    with pytest.raises(ValueError, match="chunk key 'customer' is neither"):
        PandaStackQueueOperator(task_id="e", broker="redis://x", chunk_size=2, chunk_key="customer")
    with pytest.raises(ValueError, match="chunk_size must be an int of at least 1"):
        PandaStackQueueOperator(task_id="f", broker="redis://x", chunk_size=0)

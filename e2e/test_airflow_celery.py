"""Airflow 3.3 on PostgreSQL with CeleryExecutor (Redis), api-server, scheduler,
dag-processor, triggerer and two Celery workers, against the local PandaStack server."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from pandastack_local.testing.waiting import wait_for

from .airflow_stack import WORKERS, AirflowStack, start_airflow
from .browser import chromium
from .procs import ProcessGroup
from .queue_checks import FLAKY, Stream, results_by_id
from .services import PandaStack, Postgres, Redis
from .ui_checks import airflow_connection_form

if TYPE_CHECKING:
    from e2e.brokers import Kafka

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def airflow(
    group: ProcessGroup, postgres: Postgres, redis: Redis, pandastack: PandaStack
) -> Iterator[AirflowStack]:
    with group.stopping("airflow-"):
        yield start_airflow(group, postgres, redis, pandastack)


def airflow_sandboxes(ps: PandaStack, **match: str) -> list[dict]:
    return ps.engine_sandboxes("airflow", **match)


def test_topology_is_up(airflow: AirflowStack, group: ProcessGroup) -> None:
    for name in ("api-server", "scheduler", "dag-processor", "triggerer", *WORKERS):
        assert group.get(f"airflow-{name}").alive(), f"airflow {name} is not running"
    health = airflow.request("GET", "/monitor/health")
    assert health["metadatabase"]["status"] == "healthy", health
    assert health["scheduler"]["status"] == "healthy", health


HONEST = ("acme", "globex", "initech", "umbrella")
POOL_SLOTS = 2


def test_connection_form_in_the_browser(airflow: AirflowStack) -> None:
    """The api-server UI's Add Connection form for conn type pandastack (docs/img/airflow-*.png)."""
    with chromium(airflow.group.run_dir) as driver:
        shots = airflow_connection_form(driver, airflow.api)
    assert [p.name for p in shots] == ["airflow-connection-form.png", "airflow-connection-extra-fields.png"]


def test_tenant_transforms_dag(airflow: AirflowStack, pandastack: PandaStack) -> None:
    dag_id = "pandastack_tenant_transforms"
    airflow.wait_dag(dag_id)
    # Concurrency governance: the pool bounds live sandboxes across both workers.
    airflow.ensure_pool("pandastack_sandboxes", POOL_SLOTS)
    run_id = airflow.trigger(dag_id)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], len(airflow_sandboxes(pandastack, job_run=run_id)))
            except OSError as exc:  # a sample may fail while the server is busy; the next one counts
                print(f"pool sampler: {exc}")
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        airflow.wait_run(dag_id, run_id, timeout=360)
    finally:
        stop.set()
        sampler.join(timeout=10)
    assert 1 <= peak[0] <= POOL_SLOTS, f"live sandboxes peaked at {peak[0]} with a pool of {POOL_SLOTS}"
    tis = [t for t in airflow.task_instances(dag_id, run_id) if t["task_id"] == "transform"]
    by_tenant = {t["rendered_map_index"]: t for t in tis}
    assert set(HONEST) <= set(by_tenant), sorted(by_tenant)
    for tenant in HONEST:
        ti = by_tenant[tenant]
        assert ti["state"] == "success", ti
        assert airflow.xcom(dag_id, run_id, "transform", map_index=ti["map_index"]) is not None
    for tenant in ("evil_memory_hog", "evil_fork_bomb"):
        assert by_tenant[tenant]["state"] == "failed", by_tenant[tenant]
    hosts = {t["hostname"] for t in tis}
    assert hosts <= set(WORKERS), hosts
    assert airflow.task_instance(dag_id, run_id, "summarize")["state"] == "success"
    assert airflow_sandboxes(pandastack, job_run=run_id) == []


def test_deferrable_operator_completes_through_the_triggerer(
    airflow: AirflowStack, pandastack: PandaStack
) -> None:
    airflow.wait_dag("e2e_deferrable")
    run_id = airflow.trigger("e2e_deferrable")
    seen: set[str] = set()

    def state() -> str:
        ti = airflow.task_instance("e2e_deferrable", run_id, "deferred_job")
        seen.add(str(ti["state"]))
        return str(ti["state"])

    wait_for(
        "deferred_job to finish",
        state,
        timeout=240,
        interval=0.5,
        check=lambda s: s in ("success", "failed", "upstream_failed"),
    )
    dag_run = airflow.wait_run("e2e_deferrable", run_id, timeout=60)
    assert dag_run["state"] == "success", dag_run
    assert "deferred" in seen, f"the task never deferred (states seen: {seen})"
    assert airflow.xcom("e2e_deferrable", run_id, "deferred_job") == {"value": 100, "slept": 8}
    assert airflow_sandboxes(pandastack, job_run=run_id) == []


def test_celery_worker_killed_mid_job_retries_on_the_other_worker(
    airflow: AirflowStack, pandastack: PandaStack
) -> None:
    dag_id, task_id = "e2e_worker_kill", "slow_job"
    airflow.wait_dag(dag_id)
    run_id = airflow.trigger(dag_id)

    # Wait until the job is running inside its sandbox on one of the workers.
    ti = wait_for(
        "slow_job to run on a worker",
        lambda: airflow.task_instance(dag_id, run_id, task_id),
        timeout=180,
        interval=0.5,
        check=lambda t: t["state"] == "running" and t.get("hostname") in WORKERS,
    )
    victim = ti["hostname"]
    survivor = next(w for w in WORKERS if w != victim)
    orphan = wait_for(
        "the first attempt's sandbox",
        lambda: airflow_sandboxes(pandastack, job_run=run_id, job_task=task_id),
        timeout=60,
        interval=0.5,
    )
    assert len(orphan) == 1 and orphan[0]["metadata"]["job_try"] == "1", orphan
    orphan_id = orphan[0]["id"]
    time.sleep(3)  # the job is now sleeping inside the sandbox

    # The machine dies: SIGKILL the worker and every process under it.
    airflow.workers[victim].kill_tree()
    killed_at = time.monotonic()
    assert orphan_id in {sb["id"] for sb in pandastack.sandboxes()}, "the kill alone removed the sandbox"

    dag_run = airflow.wait_run(dag_id, run_id, timeout=300)
    assert dag_run["state"] == "success", dag_run

    tries = airflow.tries(dag_id, run_id, task_id)
    by_try = {t["try_number"]: t for t in tries}
    assert by_try[1]["hostname"] == victim and by_try[1]["state"] != "success", tries
    final = airflow.task_instance(dag_id, run_id, task_id)
    assert final["state"] == "success" and final["try_number"] >= 2, final
    assert final["hostname"] == survivor, final
    # The orphan was reaped by the retry, well before its TTL backstop could have fired.
    assert orphan_id not in {sb["id"] for sb in pandastack.sandboxes()}
    assert time.monotonic() - killed_at < 180
    # Delivered once: one result in XCom, consumed once downstream.
    assert airflow.xcom(dag_id, run_id, task_id) == {"value": 42, "slept": 20}
    keys = [e["key"] for e in airflow.xcom_entries(dag_id, run_id, task_id)]
    assert keys.count("return_value") == 1, keys
    consume = airflow.task_instance(dag_id, run_id, "consume")
    assert consume["state"] == "success" and consume["try_number"] == 1, consume
    assert airflow.xcom(dag_id, run_id, "consume") == {"value": 42, "slept": 20}
    assert airflow_sandboxes(pandastack, job_run=run_id) == []


def test_queue_dag_acks_after_results_and_redelivers_a_failed_message_to_the_next_run(
    airflow: AirflowStack, pandastack: PandaStack, redis: Redis
) -> None:
    """PandaStackQueueOperator under the real scheduler and a Celery worker, on a real Redis stream:
    run 1 acks ``good`` after its result is on the reply stream, dead-letters ``poison`` and
    releases ``flaky`` (its first delivery failed); run 2 gets ``flaky`` again and acks it."""
    dag_id = "e2e_queue"
    stream = Stream.fresh(redis, "e2e-airflow")
    stream.send_scenario()
    airflow.wait_dag(dag_id)

    first = airflow.trigger(dag_id, {"broker": stream.url})
    assert airflow.wait_run(dag_id, first, timeout=240)["state"] == "success"
    assert airflow.xcom(dag_id, first, "consume") == {
        "received": 3,
        "acked": 1,
        "redelivered": 1,
        "dead_lettered": 1,
        "released_on_drain": 0,
        "reconnects": 0,
        "leases_lost": 0,
    }
    # Between the runs the broker holds flaky (released, not acked), poison (dead) and one reply.
    assert results_by_id(stream) == {"good": [{"id": "good", "delivery": 1}]}
    (dead,) = stream.dead()
    assert dead["id"] == "poison" and dead["why"]["kind"] == "permanent_exit_code", dead
    assert "bad input" in dead["why"]["stderr_tail"] and dead["why"]["deliveries"] == 1, dead
    ((waiting, due),) = stream.delayed()
    assert json.loads(waiting["body"])["id"] == "flaky" and waiting["prior"] == 1, waiting
    assert stream.depth() == {"stream": 0, "pending": 0, "delayed": 1}
    time.sleep(max(0.0, due - time.time()))  # the next scheduled run would find it due

    second = airflow.trigger(dag_id, {"broker": stream.url})
    assert airflow.wait_run(dag_id, second, timeout=240)["state"] == "success"
    summary = airflow.xcom(dag_id, second, "consume")
    assert (summary["received"], summary["acked"], summary["dead_lettered"]) == (1, 1, 0), summary
    # Each message's result delivered once; nothing left queued, leased or delayed.
    assert results_by_id(stream) == {
        "good": [{"id": "good", "delivery": 1}],
        "flaky": [{"id": "flaky", "delivery": 2}],
    }
    assert [d["id"] for d in stream.dead()] == ["poison"]
    assert stream.depth() == {"stream": 0, "pending": 0, "delayed": 0}
    assert pandastack.engine_sandboxes("queue") == []


def test_kafka_message_through_the_queue_dag_fails_once_then_succeeds(
    airflow: AirflowStack, pandastack: PandaStack, kafka: Kafka
) -> None:
    """One message on a real Apache Kafka topic, consumed by PandaStackQueueOperator under the
    real scheduler on a Celery worker: its first delivery fails redeliverably (exit 75), goes to
    the retry topic and comes back within the run; the second succeeds. Both attempts are in the
    summary, one result is on ``<topic>.results``, and the group has committed past it all."""
    dag_id = "e2e_queue_kafka"
    topic = f"e2e-kafka-{uuid.uuid4().hex[:8]}"
    producer = kafka.transport(topic)
    try:
        producer.send(json.dumps({"id": "flaky", "command": FLAKY}).encode())
    finally:
        producer.close()
    airflow.wait_dag(dag_id)

    run_id = airflow.trigger(dag_id, {"broker": kafka.url(topic)})
    assert airflow.wait_run(dag_id, run_id, timeout=240)["state"] == "success"
    assert airflow.xcom(dag_id, run_id, "consume") == {
        "received": 2,
        "acked": 1,
        "redelivered": 1,
        "dead_lettered": 0,
        "released_on_drain": 0,
        "reconnects": 0,
        "leases_lost": 0,
    }
    # One result, from the second delivery; the retry record was the one that ran.
    (result,) = kafka.results(topic)
    assert (result["id"], result["result"], result["delivery"]) == (
        "flaky",
        {"id": "flaky", "delivery": 2},
        2,
    ), result
    assert len(kafka.records(f"{topic}.retry")) == 1
    assert kafka.dead(topic) == []
    assert kafka.depth(topic) == 0  # committed past the message on the topic and its retry topic
    assert pandastack.engine_sandboxes("queue") == []


def test_no_airflow_sandbox_left(airflow: AirflowStack, pandastack: PandaStack) -> None:
    assert airflow_sandboxes(pandastack) == []

"""The consumer on the real brokers (Redis Streams, PostgreSQL, RabbitMQ, SQS on moto's server) and
the real pandastack-local: one test body per rule, parametrized over the transports."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import pytest

from e2e.brokers import Broker
from pandastack_local import LocalServer
from pandastack_local.testing.waiting import wait_for
from tests.queue.conftest import echo_job, live_sandboxes, message, wait_results

pytestmark = pytest.mark.timeout(180)


def _ids(results: list[dict[str, Any]]) -> list[str]:
    return sorted(r["id"] for r in results)


def test_ack_only_after_the_result_is_out(broker: Broker, queue: str, start_consumer: Any) -> None:
    """Each message's result reaches the sink before its ack; a sink that fails leaves the message
    for redelivery, and the redelivered job's result is the one delivered (once)."""
    t = broker.transport(queue)
    for i in range(3):
        t.send(message(echo_job(), id=f"m{i}"))
    calls: list[str] = []
    depth_at_sink: list[int] = []

    def sink(job: Any, delivery: Any, outcome: Any) -> None:
        calls.append(job.message_id)
        if broker.name != "rabbitmq":  # RabbitMQ counts only ready messages, not those we hold
            depth_at_sink.append(broker.depth(queue))
        if job.message_id == "m1" and delivery.count == 1:
            raise OSError("object storage is down")
        t.reply(json.dumps(outcome.result).encode())

    stats = start_consumer(until=lambda s: s.acked >= 3, sink=sink, concurrency=2).join(60)
    results = broker.results(queue)
    assert _ids(results) == ["m0", "m1", "m2"], results
    assert {r["id"]: r["delivery"] for r in results}["m1"] == 2  # the failed sink's message came back
    assert sorted(calls) == ["m0", "m1", "m1", "m2"]
    assert all(d >= 1 for d in depth_at_sink), depth_at_sink  # still queued while its result went out
    assert stats.acked == 3 and stats.redelivered == 1 and stats.dead_lettered == 0
    assert broker.depth(queue) == 0


def test_redelivered_failure_then_success(broker: Broker, queue: str, start_consumer: Any) -> None:
    """A redeliverable failure (exit 1) is released, redelivered in a fresh sandbox, and then acked."""
    broker.transport(queue).send(message(f'[ "$QUEUE_DELIVERY" -ge 3 ] || exit 1; {echo_job()}', id="flaky"))
    stats = start_consumer(until=lambda s: s.acked >= 1, max_deliveries=5).join(60)
    (result,) = wait_results(broker, queue, 1)
    assert result["ok"] is True and result["result"] == {"id": "flaky", "delivery": 3}
    assert stats.redelivered == 2 and stats.acked == 1 and stats.dead_lettered == 0
    assert broker.dead(queue) == [] and broker.depth(queue) == 0


def test_dead_letter_after_max_deliveries_and_on_permanent_failure(
    broker: Broker, queue: str, start_consumer: Any
) -> None:
    """A job that always fails is dead-lettered after max_deliveries with the reason, the kind and the
    output tail; a permanent exit code is dead-lettered on its first delivery."""
    t = broker.transport(queue)
    t.send(message("echo boom-out; echo boom-err >&2; exit 1", id="always"))
    t.send(message("exit 7", id="perm", permanent_exit_codes=[7]))
    stats = start_consumer(until=lambda s: s.dead_lettered >= 2, max_deliveries=2).join(60)
    dead = {json.loads(d["body"])["id"]: d["why"] for d in broker.dead(queue)}
    assert set(dead) == {"always", "perm"}
    assert dead["always"]["kind"] == "exit_code" and dead["always"]["deliveries"] == 2
    assert "gave up after 2 deliveries" in dead["always"]["reason"] and "boom-err" in dead["always"]["reason"]
    assert "boom-out" in dead["always"]["stdout_tail"] and "boom-err" in dead["always"]["stderr_tail"]
    assert dead["perm"]["kind"] == "permanent_exit_code" and dead["perm"]["deliveries"] == 1
    assert stats.redelivered == 1 and broker.results(queue) == [] and broker.depth(queue) == 0


def test_malformed_messages_are_dead_lettered_and_the_consumer_goes_on(
    broker: Broker, queue: str, start_consumer: Any
) -> None:
    t = broker.transport(queue)
    bad = {
        "body": b"this is not json",
        "format": json.dumps({"format": "celery/4", "command": "true"}).encode(),
        "command": json.dumps({"command": 5}).encode(),
        "colour": json.dumps({"command": "true", "colour": "red"}).encode(),
        "options.timeout": json.dumps({"command": "true", "options": {"timeout": -1}}).encode(),
        "options.key": json.dumps({"command": "true", "options": {"key": "x"}}).encode(),
        # a tenant's message may not make the consumer read more into its own memory
        "options.max_result_bytes": json.dumps(
            {"command": "true", "options": {"max_result_bytes": 10**12}}
        ).encode(),
        "oversized": json.dumps({"command": "true", "input": "x" * 3000}).encode(),
    }
    for body in bad.values():
        t.send(body)
    t.send(message(echo_job(), id="good"))
    stats = start_consumer(
        until=lambda s: s.acked >= 1 and s.dead_lettered >= len(bad), max_message_bytes=2048
    ).join(60)
    fields = sorted(d["why"]["field"] for d in broker.dead(queue))
    expected = [
        "body",
        "body",
        "colour",
        "command",
        "format",
        "options.key",
        "options.max_result_bytes",
        "options.timeout",
    ]
    assert fields == expected
    whys = [d["why"] for d in broker.dead(queue)]
    assert all(w["kind"] == "malformed" and w["reason"].startswith(w["field"]) for w in whys), whys
    assert any("over the 2048-byte limit" in w["reason"] for w in whys)
    assert _ids([r["result"] for r in broker.results(queue)]) == ["good"]
    assert stats.acked == 1 and broker.depth(queue) == 0


def test_a_job_longer_than_the_lease_runs_once(
    broker: Broker, queue: str, start_consumer: Any, local_server: LocalServer
) -> None:
    """Lease 1.5 s, job 5 s, a second consumer waiting for expired leases: the lease is extended, the
    message is delivered once, one sandbox runs it. Kafka has no lease, but the second consumer's
    join is a rebalance: if it takes the job's partition, the first consumer's job is cancelled
    unsettled and the new owner runs it; still one result."""
    broker.transport(queue).send(message(echo_job(5), id="long"))
    a = start_consumer(lease=1.5, concurrency=1)
    wait_for("the job to start", lambda: a.consumer.stats.in_flight, timeout=30, interval=0.1)
    b = start_consumer(lease=1.5, concurrency=1)
    (result,) = wait_results(broker, queue, 1)
    for r in (a, b):
        r.consumer.stop()
    a_stats, b_stats = a.join(30), b.join(30)
    assert len(broker.results(queue)) == 1 and broker.depth(queue) == 0
    if broker.name == "kafka" and b_stats.received:
        assert result["result"] == {"id": "long", "delivery": 2}
        assert a_stats.acked == 0 and b_stats.acked == 1
        assert live_sandboxes(local_server, queue_message_id="long") == []  # the cancelled attempt's too
    else:
        assert result["result"] == {"id": "long", "delivery": 1}
        assert b_stats.received == 0 and a_stats.acked == 1


def test_concurrency_cap(broker: Broker, queue: str, start_consumer: Any, local_server: LocalServer) -> None:
    """Concurrency 2: never more than 2 live sandboxes of this queue, and every message done."""
    t = broker.transport(queue)
    for i in range(6):
        t.send(message(echo_job(1), id=f"c{i}"))
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], len(live_sandboxes(local_server, job_workflow=queue)))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stats = start_consumer(until=lambda s: s.acked >= 6, concurrency=2).join(90)
    done.set()
    sampler.join(5)
    assert 1 <= peak[0] <= 2, peak
    assert stats.peak_in_flight == 2
    assert _ids([r["result"] for r in broker.results(queue)]) == [f"c{i}" for i in range(6)]


def test_two_consumers_share_the_work_each_message_once(
    broker: Broker, queue: str, start_consumer: Any
) -> None:
    """Two consumers on one queue: each message is run once, and both take a share. The messages are
    sent once both pull: a consumer that connects late (a loaded host) would otherwise find the
    first one done with all eight, which says nothing about sharing."""
    total = lambda _s: sum(r.consumer.stats.acked for r in runs) >= 8  # noqa: E731
    runs: list[Any] = []
    runs.append(start_consumer(until=total, concurrency=2))
    runs.append(start_consumer(until=total, concurrency=2))
    for r in runs:
        assert r.consumer.ready.wait(30), "a consumer did not connect to the broker in 30 s"
    if broker.name == "kafka":
        # Ready is connected; a Kafka member pulls only once the group's rebalance gave it
        # partitions (until then the first one owns all four and would take all eight).
        wait_for(
            "both consumers to own partitions",
            lambda: all(r.consumer.transport.owned() for r in runs),
            timeout=60,
            interval=0.1,
        )
    t = broker.transport(queue)
    for i in range(8):
        t.send(message(echo_job(0.5), id=f"s{i:02d}"))
    stats = [r.join(90) for r in runs]
    results = broker.results(queue)
    assert _ids([r["result"] for r in results]) == [f"s{i:02d}" for i in range(8)]  # each once
    assert all(r["delivery"] == 1 for r in results)
    assert all(s.acked >= 1 for s in stats), [s.acked for s in stats]
    assert broker.depth(queue) == 0


@pytest.mark.parametrize("broker", ["postgres"], indirect=True)
def test_a_postgres_receive_takes_no_more_than_asked_whatever_the_plan(
    broker: Broker, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receive of 2 leases 2 rows, whichever plan PostgreSQL picks. With the planner steered to a
    nested-loop semi join (as it chose on its own in a loaded full run), the old ``WHERE id IN
    (SELECT ... LIMIT 2 FOR UPDATE SKIP LOCKED)`` ran its subquery once per outer row and leased all
    8 ready rows: one consumer took the whole queue and a second one found nothing."""
    producer = broker.transport(queue)
    for i in range(8):
        producer.send(message(echo_job(), id=f"p{i}"))
    off = ("hashjoin", "mergejoin", "hashagg", "material", "sort")
    monkeypatch.setenv("PGOPTIONS", " ".join(f"-c enable_{name}=off" for name in off))
    first, second = broker.transport(queue), broker.transport(queue)
    assert len(first.receive(2, 0)) == 2
    assert len(second.receive(2, 0)) == 2
    assert len(first.receive(8, 0)) == 4
    for t in (producer, first, second):
        t.close()


def test_sigterm_drains(broker: Broker, queue: str, spawn_worker: Any, local_server: LocalServer) -> None:
    """SIGTERM: no more pulls; the running job that fits the drain deadline finishes and is acked; the
    one that does not is cancelled and released; what was never started stays queued."""
    t = broker.transport(queue)
    t.send(message(echo_job(2), id="short"))
    t.send(message(echo_job(60), id="long"))
    w = spawn_worker("--concurrency", "2", "--drain", "5")
    wait_for(
        "two running jobs",
        lambda: len(live_sandboxes(local_server, job_workflow=queue)),
        timeout=60,
        interval=0.1,
        check=lambda n: n == 2,
    )
    for i in range(3):
        t.send(message(echo_job(), id=f"later{i}"))
    started = time.monotonic()
    w.signal(signal.SIGTERM)
    assert w.wait(30) == 0, w.text()
    assert time.monotonic() - started < 15
    assert [r["result"]["id"] for r in broker.results(queue)] == ["short"]
    assert "stopped:" in w.text() and "pandastack-jobs: in flight 2  acked 0" in w.text()  # the progress line
    wait_for(
        "the released and unstarted messages queued",
        lambda: broker.depth(queue),
        timeout=20,
        check=lambda n: n == 4,
    )
    assert live_sandboxes(local_server, job_workflow=queue) == []


def test_worker_sigkill_mid_job(
    broker: Broker, queue: str, spawn_worker: Any, local_server: LocalServer
) -> None:
    """A SIGKILLed worker's message comes back to the next worker, runs once more, its result is
    delivered once, and the killed attempt's sandbox is reaped."""
    broker.transport(queue).send(message(echo_job(3), id="victim"))
    first = spawn_worker("--concurrency", "1")
    (orphan,) = wait_for(
        "the job's sandbox",
        lambda: live_sandboxes(local_server, queue_message_id="victim"),
        timeout=60,
        interval=0.1,
    )
    first.signal(signal.SIGKILL)
    first.wait(10)
    assert live_sandboxes(local_server, queue_message_id="victim")  # the killed worker's sandbox is left
    second = spawn_worker("--concurrency", "1")
    (result,) = wait_results(broker, queue, 1, timeout=90)
    assert result["result"] == {"id": "victim", "delivery": 2}
    wait_for(
        "no sandbox of the message",
        lambda: live_sandboxes(local_server, queue_message_id="victim"),
        timeout=30,
        check=lambda sbs: sbs == [],
    )
    time.sleep(1)
    second.signal(signal.SIGTERM)
    assert second.wait(30) == 0
    assert len(broker.results(queue)) == 1 and broker.depth(queue) == 0
    assert orphan.id not in {sb.id for sb in local_server.client().sandboxes.list()}


def test_broker_restart_mid_run(broker: Broker, queue: str, start_consumer: Any) -> None:
    """The broker restarts while jobs run (SQS: the network to it is cut, see brokers.SQS): the
    consumer reconnects and every message is done."""
    t = broker.transport(queue)
    for i in range(4):
        t.send(message(echo_job(2), id=f"r{i}"))
    t.close()
    run = start_consumer(until=lambda s: s.acked >= 4, concurrency=2)
    wait_for("jobs running", lambda: run.consumer.stats.in_flight, timeout=30, interval=0.1)
    broker.restart(down_seconds=3)  # longer than a job: finished jobs wait for the broker
    stats = run.join(120)
    assert stats.reconnects >= 1
    assert set(_ids([r["result"] for r in broker.results(queue)])) == {f"r{i}" for i in range(4)}
    assert broker.depth(queue) == 0


class _Spy:
    """The real transport, with its releases and receives recorded (every call goes to the broker)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.releases: list[float] = []
        self.received_at: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def receive(self, n: int, wait: float) -> Any:
        got = self.inner.receive(n, wait)
        self.received_at.extend(time.monotonic() for _ in got)
        return got

    def release(self, delivery: Any, delay: float) -> None:
        self.releases.append(delay)
        self.inner.release(delivery, delay)


def test_a_capacity_refusal_is_redelivered_no_sooner_than_retry_after(
    broker: Broker, queue: str, make_local_server: Any
) -> None:
    """The server is full (max_sandboxes=1, held): the job is refused past the SDK's budget, the
    message is released with a delay of at least the server's Retry-After (not --release-delay),
    comes back no sooner, and runs once the server has room."""
    from pandastack_jobs import ConnectionConfig
    from pandastack_jobs.queue import Consumer

    server = make_local_server(max_sandboxes=1)
    holder = server.client().sandboxes.create(template="base", ttl_seconds=60)
    broker.transport(queue).send(message(echo_job(), id="full"))
    spy = _Spy(broker.transport(queue))
    conn = ConnectionConfig(api_url=server.url, api_key=server.api_key, max_create_retry_seconds=0)
    consumer = Consumer(spy, conn, defaults={"template": "base"}, release_delay=0.1, poll_seconds=0.2)  # type: ignore[arg-type]
    released = threading.Thread(
        target=lambda: (wait_for("a release", lambda: spy.releases, timeout=30, interval=0.05), holder.kill())
    )
    released.start()
    stats = consumer.run(lambda s: s.acked >= 1)
    released.join(10)
    assert stats.redelivered == 1 and stats.acked == 1
    (delay,) = spy.releases
    assert delay >= 1.0  # the server's Retry-After, not the 0.1 s release delay
    assert spy.received_at[1] - spy.received_at[0] >= delay - 0.05
    (result,) = broker.results(queue)
    assert result["result"] == {"id": "full", "delivery": 2}


def test_sigterm_while_the_broker_is_down(
    broker: Broker, queue: str, spawn_worker: Any, local_server: LocalServer
) -> None:
    """SIGTERM with the broker gone: the worker still leaves within its drain deadline (exit 3,
    saying so), its running job cancelled (no sandbox left); the unacked message is done by the
    next worker once the broker is back."""
    broker.transport(queue).send(message(echo_job(8), id="stranded"))
    w = spawn_worker("--concurrency", "1", "--drain", "2")
    wait_for(
        "the job's sandbox",
        lambda: live_sandboxes(local_server, queue_message_id="stranded"),
        timeout=60,
        interval=0.1,
    )
    broker.down()
    try:
        # The worker is in its reconnect loop before the signal comes (the case that once hung).
        wait_for("the worker to notice", lambda: "broker unavailable" in w.text(), timeout=30, interval=0.1)
        started = time.monotonic()
        w.signal(signal.SIGTERM)
        assert w.wait(30) == 3, w.text()
        assert time.monotonic() - started < 15
        assert "lost the broker while stopping" in w.text()
        assert live_sandboxes(local_server, queue_message_id="stranded") == []
    finally:
        broker.up()
    t = broker.transport(queue)
    t.send(message(echo_job(), id="after"))
    spawn_worker("--concurrency", "2")
    results = wait_results(broker, queue, 2, timeout=90)
    by_id = {r["result"]["id"]: r["result"]["delivery"] for r in results}
    assert by_id["after"] == 1 and by_id["stranded"] >= 2, by_id


def test_a_message_delivered_past_max_deliveries_is_dead_lettered_before_it_runs(
    broker: Broker, queue: str, start_consumer: Any, local_server: LocalServer
) -> None:
    """A message whose earlier deliveries left no outcome (a worker died with it each time) is
    dead-lettered on arrival once its delivery count is past max_deliveries, without a sandbox."""
    t = broker.transport(queue)
    t.send(message(echo_job(), id="crasher"))
    for _ in range(2):  # two deliveries that end without an outcome, as a dying worker's do
        (d,) = wait_for("a delivery", lambda: t.receive(1, 0.5), timeout=30, interval=0.1)
        t.release(d, 0)
    t.close()  # Kafka: leave the group, or the consumer's join waits for this idle member
    stats = start_consumer(until=lambda s: s.dead_lettered >= 1, max_deliveries=2).join(60)
    (dead,) = broker.dead(queue)
    assert dead["why"]["kind"] == "max_deliveries" and dead["why"]["deliveries"] == 3, dead["why"]
    assert "over max_deliveries=2" in dead["why"]["reason"]
    assert stats.acked == 0 and broker.results(queue) == [] and broker.depth(queue) == 0
    assert live_sandboxes(local_server, queue_message_id="crasher") == []

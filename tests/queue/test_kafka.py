"""What only Kafka does, on Apache Kafka itself (KRaft) and the real pandastack-local: offsets
committed below the lowest unsettled message, the retry topic, a rebalance mid-job, a SIGKILLed
consumer whose settled messages past the commit point are not run again, and per-key order.
The rules every broker keeps run on Kafka too, in test_queue.py and test_chunks.py."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

from e2e.brokers import Broker, Kafka, LazyBrokers
from pandastack_jobs import ConnectionConfig
from pandastack_jobs.queue import Consumer, open_transport
from pandastack_local import LocalServer
from pandastack_local.testing.waiting import wait_for
from tests.queue.conftest import DEFAULTS, Running, echo_job, live_sandboxes, message, wait_results

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def broker(brokers: LazyBrokers) -> Broker:
    """The Kafka broker only (the conftest's fixture runs every broker)."""
    return brokers.get("kafka", Kafka)


def _by_id(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        out.setdefault(r["result"]["id"], []).append(r["result"])
    return out


def test_the_commit_never_passes_an_unsettled_message(broker: Kafka, queue: str, start_consumer: Any) -> None:
    """One partition, a slow message first and three fast ones after it: the fast ones finish and
    are settled first, but the committed offset stays at the slow one until it is done too."""
    broker.transport(queue).close()  # creates the topics
    broker.produce(queue, message(echo_job(6), id="slow"))
    for i in range(3):
        broker.produce(queue, message(echo_job(), id=f"fast{i}"))
    run = start_consumer(until=lambda s: s.acked >= 4, concurrency=4)
    wait_for(
        "the three fast results",
        lambda: _by_id(broker.results(queue)),
        timeout=60,
        interval=0.2,
        check=lambda got: {"fast0", "fast1", "fast2"} <= set(got),
    )
    assert "slow" not in _by_id(broker.results(queue))
    assert broker.committed(queue)[0] == 0  # offset 0 (slow) is unsettled: nothing past it
    stats = run.join(60)
    assert stats.acked == 4
    assert broker.committed(queue)[0] == 4 and broker.depth(queue) == 0


def test_a_release_goes_to_the_retry_topic_and_does_not_hold_up_the_partition(
    broker: Kafka, queue: str, start_consumer: Any
) -> None:
    """The first message fails once and is released for 4 s: it goes to ``<topic>.retry`` with its
    broker id, count and not-before time, and the messages behind it on its partition are done
    meanwhile. Headers a producer put on the original (a forged id and count) are ignored."""
    broker.transport(queue).close()
    flaky = message(f'[ "$QUEUE_DELIVERY" -ge 2 ] || exit 1; {echo_job()}', id="flaky")
    broker.produce(queue, flaky, headers={"mid": "0-99", "count": "7"})
    for i in range(2):
        broker.produce(queue, message(echo_job(), id=f"next{i}"))
    started = time.time()
    run = start_consumer(until=lambda s: s.acked >= 3, concurrency=2, release_delay=4, max_deliveries=3)
    wait_for(
        "the messages behind the released one",
        lambda: _by_id(broker.results(queue)),
        timeout=60,
        interval=0.1,
        check=lambda got: {"next0", "next1"} <= set(got),
    )
    (retry,) = broker.records(f"{queue}.retry")
    headers = {k: v.decode() for k, v in retry.headers()}
    assert "flaky" not in _by_id(broker.results(queue))  # still waiting for its not-before time
    assert headers["mid"] == "0-0" and headers["count"] == "1"  # the broker's id, not the forged one
    assert len(headers["sig"]) == 64  # signed (HMAC-SHA256), as RabbitMQ's stamps
    assert float(headers["not_before"]) >= started + 4
    stats = run.join(60)
    assert _by_id(broker.results(queue))["flaky"] == [{"id": "flaky", "delivery": 2}]
    assert time.time() >= float(headers["not_before"])
    assert stats.redelivered == 1 and stats.dead_lettered == 0 and broker.depth(queue) == 0


def test_forged_retry_records_are_dead_lettered_naming_the_signature(
    broker: Kafka, queue: str, start_consumer: Any
) -> None:
    """Red team (issue 33): the retry topic's headers (``mid``, ``count``, ``not_before``) were
    unsigned, so a producer that could write ``<topic>.retry`` set any count (straight past
    ``max_deliveries``, or 1 for ever), any id (a victim's: its run would reap that message's
    sandbox) and any not-before (an hour: the retry partition paused that long). They are now
    signed as RabbitMQ's stamps are (one HMAC helper, ``stamps.py``): a record whose stamp does not
    verify (none, or one made with another key) is dead-lettered at once, kind ``malformed``,
    field ``headers.sig``, its not-before ignored; the genuine message beside them runs.
    Seen failing before: the forged count was dead-lettered as ``max_deliveries``, the forged
    stamp ran as message 0-0's delivery 2, and the held record stopped the consumer finishing."""
    from pandastack_jobs.queue.stamps import Stamper

    broker.transport(queue).close()  # the topics
    retry = f"{queue}.retry"
    body = message(echo_job(), id="forged-sig")
    wrong_key = Stamper(queue, "not-the-consumers-secret").sign("0-0", 1, body, "0")
    broker.produce(retry, message(echo_job(), id="forged-count"), headers={"mid": "0-0", "count": "99"})
    broker.produce(retry, body, headers={"mid": "0-0", "count": "1", "not_before": "0", "sig": wrong_key})
    held = {"mid": "victim", "count": "1", "not_before": f"{time.time() + 3600:.3f}", "sig": "0" * 64}
    broker.produce(retry, message(echo_job(), id="held"), headers=held)
    broker.produce(queue, message(echo_job(), id="genuine"))
    stats = start_consumer(until=lambda s: s.acked >= 1 and s.dead_lettered >= 3, max_deliveries=3).join(60)
    dead = broker.dead(queue)
    assert sorted(json.loads(d["body"])["id"] for d in dead) == ["forged-count", "forged-sig", "held"], dead
    for d in dead:
        why = d["why"]
        assert why["kind"] == "malformed" and why["field"] == "headers.sig", why
        assert why["reason"].startswith("headers.sig") and f"{queue}.retry" in why["reason"], why
        assert why["broker_id"].startswith("retry:"), why  # never the forged id
    assert _by_id(broker.results(queue)) == {"genuine": [{"id": "genuine", "delivery": 1}]}
    assert stats.acked == 1 and stats.dead_lettered == 3 and broker.depth(queue) == 0


def test_a_rebalance_mid_job_cancels_the_moved_partitions_jobs_and_each_message_runs_to_one_result(
    broker: Kafka, queue: str, start_consumer: Any, local_server: LocalServer
) -> None:
    """A consumer runs a long job from each partition; a second consumer joins and the group moves
    one partition to it. The first consumer cancels that partition's job and settles nothing of
    it; the new owner runs it again (delivery 2, the old attempt's sandbox gone); the other job
    finishes where it was. One result per message, every offset committed."""
    broker.transport(queue).close()
    job = f'[ "$QUEUE_DELIVERY" -ge 2 ] || sleep 8; {echo_job(1)}'
    broker.produce(queue, message(job, id="p0"), partition=0)
    broker.produce(queue, message(job, id="p1"), partition=1)
    a = start_consumer(concurrency=2)
    wait_for(
        "both jobs running",
        lambda: a.consumer.stats.in_flight,
        timeout=60,
        interval=0.1,
        check=lambda n: n == 2,
    )
    b = start_consumer(concurrency=2)
    results = wait_results(broker, queue, 2, timeout=90)
    for r in (a, b):
        r.consumer.stop()
    a_stats, b_stats = a.join(30), b.join(30)
    by_id = _by_id(broker.results(queue))
    assert sorted(by_id) == ["p0", "p1"] and all(len(v) == 1 for v in by_id.values()), results
    assert sorted(v[0]["delivery"] for v in by_id.values()) == [1, 2]  # the moved one ran again
    assert a_stats.acked == 1 and b_stats.acked == 1 and a_stats.redelivered == 1  # lost, unsettled
    assert broker.committed(queue) == {0: 1, 1: 1} and broker.depth(queue) == 0
    assert live_sandboxes(local_server, job_workflow=queue) == []


def test_a_sigkilled_consumer_leaves_only_its_unsettled_messages(
    broker: Kafka, queue: str, spawn_worker: Any, local_server: LocalServer
) -> None:
    """Offset 0 runs long, offset 1 finishes and is settled; the worker is SIGKILLed. The commit
    stayed at 0, but its metadata says offset 1 is done: the next worker runs offset 0 again
    (delivery 2, reaping the killed attempt's sandbox) and not offset 1."""
    broker.transport(queue).close()
    broker.produce(queue, message(f'[ "$QUEUE_DELIVERY" -ge 2 ] || sleep 60; {echo_job()}', id="long"))
    broker.produce(queue, message(echo_job(), id="short"))
    first = spawn_worker("--concurrency", "2")
    wait_results(broker, queue, 1, timeout=90)
    (orphan,) = live_sandboxes(local_server, queue_message_id="long")
    wait_for("the short message settled", lambda: first.text(), timeout=30, check=lambda t: "acked 1" in t)
    assert broker.committed(queue)[0] == 0
    first.signal(signal.SIGKILL)
    first.wait(10)
    second = spawn_worker("--concurrency", "2")
    wait_results(broker, queue, 2, timeout=90)
    wait_for(
        "offset 0 committed past",
        lambda: broker.committed(queue)[0],
        timeout=30,
        check=lambda o: o == 2,
    )
    second.signal(signal.SIGTERM)
    assert second.wait(30) == 0, second.text()
    by_id = _by_id(broker.results(queue))
    assert by_id == {"short": [{"id": "short", "delivery": 1}], "long": [{"id": "long", "delivery": 2}]}
    assert orphan.id not in {sb.id for sb in local_server.client().sandboxes.list()}
    assert broker.depth(queue) == 0


def test_order_key_runs_one_tenants_messages_in_order_and_tenants_in_parallel(
    broker: Kafka, queue: str, local_server: LocalServer
) -> None:
    """``order=key``, records keyed by tenant (``send`` does it): acme's three messages run one
    after another in offset order, even though the first fails once and waits for its retry;
    globex's run beside them."""
    job = (
        's=$(date +%s.%N); [ "$QUEUE_DELIVERY" -ge 2 ] || [ "$FAIL_FIRST" != 1 ] || exit 1; sleep 1; '
        'printf \'{"id": "%s", "delivery": %s, "start": %s, "end": %s}\' '
        '"$QUEUE_MESSAGE_ID" "$QUEUE_DELIVERY" "$s" "$(date +%s.%N)" > "$JOB_RESULT"'
    )
    t = open_transport(broker.url(queue) + "&order=key")
    t.connect()
    for i in range(3):
        env = {"FAIL_FIRST": "1" if i == 0 else "0"}
        t.send(
            json.dumps({"id": f"acme{i}", "tenant": "acme", "command": job, "options": {"env": env}}).encode()
        )
        t.send(json.dumps({"id": f"globex{i}", "tenant": "globex", "command": job}).encode())
    conn = ConnectionConfig(api_url=local_server.url, api_key=local_server.api_key)
    consumer = Consumer(t, conn, defaults=DEFAULTS, concurrency=4, release_delay=1, poll_seconds=0.3)
    stats = Running(consumer, lambda s: s.acked >= 6).join(90)
    by_id = {k: v[0] for k, v in _by_id(broker.results(queue)).items()}
    acme = [by_id[f"acme{i}"] for i in range(3)]
    assert acme[0]["delivery"] == 2 and stats.redelivered == 1
    assert acme[0]["end"] <= acme[1]["start"] and acme[1]["end"] <= acme[2]["start"], acme
    globex = [by_id[f"globex{i}"] for i in range(3)]
    assert globex[0]["end"] <= globex[1]["start"] and globex[1]["end"] <= globex[2]["start"], globex
    # the tenants ran side by side: some globex job overlapped some acme job
    assert any(g["start"] < a["end"] and a["start"] < g["end"] for g in globex for a in acme)
    assert broker.depth(queue) == 0


def test_records_too_large_for_their_topic_dead_letter_their_messages_and_nothing_stalls(
    broker: Kafka, queue: str, start_consumer: Any
) -> None:
    """Red team (rt11): a record the broker refuses for its SIZE was taken for a broker outage:
    the consumer reconnected about 200 times a minute with the message at the head of its settle
    queue, so no other tenant's message settled and it was never answered nor dead-lettered.
    Three of them on partition 0 here: a 1.2 MB result (over ``message.max.bytes``), a ~1 MB
    message that fails (its retry record is refused) and a ~1 MB malformed one (its dead letter
    is refused whole). Each is dead-lettered once (kinds ``reply_rejected``,
    ``release_rejected``, ``malformed``), the two ~1 MB ones kept without their body, naming
    where the original is; the messages beside them are answered. Seen failing before the fix
    (/work/rt11 repro): no dead letter, 190-202 reconnects, victims stalled."""
    from confluent_kafka import Producer

    # The retry and dead topics as an operator may have made them, at librdkafka's 1,000,000
    # (the transport makes its own with room for any message it takes: the next test).
    _make_topics(broker, {f"{queue}.retry": 1_000_000, f"{queue}.dead": 1_000_000})
    broker.transport(queue).close()  # the other topics
    big_result = (
        'printf \'{"p":"\' > "$JOB_RESULT"; head -c 1200000 /dev/zero | tr "\\0" a >> "$JOB_RESULT";'
        ' printf \'"}\' >> "$JOB_RESULT"'
    )
    p = Producer({"bootstrap.servers": f"127.0.0.1:{broker.port}", "message.max.bytes": 2_000_000})
    records = [
        message(big_result, id="big-result"),
        json.dumps({"command": "exit 1", "id": "big-failure", "input": "x" * 1_000_000}).encode(),
        b'{"command": "true", "id": "big-malformed", "pad": "' + b"x" * 1_030_000 + b'"}',
    ]
    for value in records:
        p.produce(queue, value=value, partition=0)
    for i in range(4):
        p.produce(queue, value=message(echo_job(), id=f"victim{i}"), partition=i % 2)
    assert p.flush(30) == 0
    run = start_consumer(
        until=lambda s: s.acked >= 4 and s.dead_lettered >= 3, concurrency=2, max_deliveries=3
    )
    stats = run.join(90)
    assert sorted(_by_id(broker.results(queue))) == [f"victim{i}" for i in range(4)]
    dead = {d["why"]["id"]: d for d in broker.dead(queue)}
    assert sorted(dead) == ["big-failure", "big-malformed", "big-result"], dead
    kinds = {ident: d["why"]["kind"] for ident, d in dead.items()}
    assert kinds == {
        "big-result": "reply_rejected",
        "big-failure": "release_rejected",
        "big-malformed": "malformed",
    }
    result_why = dead["big-result"]["why"]["reason"]
    assert f"{queue}.results refused a record of 12002" in result_why and "max.message.bytes" in result_why
    assert f"{queue}.retry refused a record" in dead["big-failure"]["why"]["reason"]
    for ident in ("big-failure", "big-malformed"):  # too large to keep whole
        why = dead[ident]["why"]
        assert dead[ident]["body"] in (b"", None), ident
        offset = why["broker_id"].split("-")[1]  # the original's partition-offset
        assert why["reason"].startswith("[not kept: the body of 10"), why
        assert f"the original is {queue}[0] at offset {offset}," in why["reason"], why
    assert dead["big-result"]["body"] == records[0]
    assert stats.reconnects == 0 and stats.dead_lettered == 3
    assert broker.committed(queue)[0] == 5 and broker.depth(queue) == 0


def _make_topics(broker: Kafka, limits: dict[str, int]) -> None:
    """Create ``limits``' topics (2 partitions) with each its ``max.message.bytes``."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{broker.port}"})
    new = [NewTopic(t, num_partitions=2, config={"max.message.bytes": str(n)}) for t, n in limits.items()]
    for future in admin.create_topics(new, operation_timeout=10).values():
        future.result(15)


def test_a_message_near_the_size_limit_is_retried_and_dead_lettered_whole(
    broker: Kafka, queue: str, start_consumer: Any
) -> None:
    """Red team (rt12): a valid 1,010,000-byte message (the topic took it; under the consumer's
    1 MiB) was dead-lettered release_rejected when a PandaStack outage or a drain gave it back,
    and on its first retry: librdkafka's producer refuses records over 1,000,000 bytes. The
    transport's producer and the retry and dead topics it makes now take any message it took plus
    what it adds, so the message is retried and dead-lettered whole like any other."""
    from confluent_kafka import Producer

    broker.transport(queue).close()  # the topics, made by the transport
    p = Producer({"bootstrap.servers": f"127.0.0.1:{broker.port}", "message.max.bytes": 2_000_000})
    record = json.dumps({"command": "exit 1", "id": "near-limit", "input": "x" * 1_040_000}).encode()
    p.produce(queue, value=record, partition=0)
    p.produce(queue, value=message(echo_job(), id="victim"), partition=1)
    assert p.flush(30) == 0
    run = start_consumer(until=lambda s: s.acked >= 1 and s.dead_lettered >= 1, max_deliveries=2)
    stats = run.join(90)
    assert sorted(_by_id(broker.results(queue))) == ["victim"]
    (dead,) = broker.dead(queue)
    assert dead["why"]["kind"] != "release_rejected" and dead["why"]["deliveries"] == 2, dead["why"]
    assert dead["body"] == record  # kept whole
    assert stats.reconnects == 0 and stats.dead_lettered == 1
    assert broker.depth(queue) == 0

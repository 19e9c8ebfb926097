"""Issue 33 on the four real brokers: a job's identity comes from the broker, nothing a producer
writes is consumer bookkeeping, and no message can stop the consumer.

Each test is a hostile producer's move through the documented interfaces (``pandastack-jobs
send``, the broker's own client), with a real consumer and the real ``pandastack-local``."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import pytest

from e2e.brokers import AWS_ENV, Broker, Kafka
from pandastack_local import LocalServer
from pandastack_local.testing.waiting import wait_for
from tests.queue.conftest import REPO, live_sandboxes, wait_results

pytestmark = pytest.mark.timeout(180)


def _msg(command: str, id: str | None = None, tenant: str | None = None, **extra: Any) -> bytes:
    doc: dict[str, Any] = {"command": command, **extra}
    if id is not None:
        doc["id"] = id
    if tenant is not None:
        doc["tenant"] = tenant
    return json.dumps(doc).encode()


def _result_job(value: str, sleep: float = 0) -> str:
    pre = f"sleep {sleep} && " if sleep else ""
    return pre + f'printf \'{{"v": "{value}", "delivery": %s}}\' "$QUEUE_DELIVERY" > "$JOB_RESULT"'


def test_two_tenants_one_id_run_independently(
    broker: Broker, queue: str, start_consumer: Any, local_server: LocalServer
) -> None:
    """Tenant `attacker` sends a message with the id of tenant `victim`'s running message, failing
    once: its redelivery must not reap the victim's sandbox (the victim's one reply is genuine,
    from its first delivery and its first sandbox), and the attacker's reply is its own (its
    tenant, another broker id). On the old code the id was the job key: the attacker's second
    delivery deleted the victim's sandbox mid-job."""
    t = broker.transport(queue)
    t.send(_msg(_result_job("genuine", sleep=4), id="order-42", tenant="victim"))
    run = start_consumer(until=lambda s: s.acked >= 2, concurrency=2, max_deliveries=3)
    (victim_sb,) = wait_for(
        "the victim's sandbox",
        lambda: live_sandboxes(local_server, tenant="victim"),
        timeout=60,
        interval=0.05,
    )
    forged = f'[ "$QUEUE_DELIVERY" -ge 2 ] || exit 1; {_result_job("forged by attacker")}'
    t.send(_msg(forged, id="order-42", tenant="attacker"))
    stats = run.join(90)
    results = wait_results(broker, queue, 2)
    assert len(results) == 2, results
    (genuine,) = [r for r in results if r["result"]["v"] == "genuine"]
    assert genuine["result"]["delivery"] == 1, genuine  # never killed and run again
    assert genuine["sandbox_id"] == victim_sb.id, genuine
    by_tenant = {r.get("tenant"): r for r in results}
    assert set(by_tenant) == {"victim", "attacker"}, results
    victim, attacker = by_tenant["victim"], by_tenant["attacker"]
    assert victim["id"] == attacker["id"] == "order-42"
    assert victim["result"] == {"v": "genuine", "delivery": 1}, victim
    assert victim["sandbox_id"] == victim_sb.id  # its first sandbox was never reaped
    assert attacker["result"] == {"v": "forged by attacker", "delivery": 2}, attacker
    assert victim["broker_id"] and attacker["broker_id"] and victim["broker_id"] != attacker["broker_id"]
    assert stats.acked == 2 and stats.redelivered == 1 and broker.dead(queue) == []
    assert broker.depth(queue) == 0


def _send_cli(broker: Broker, queue: str, body: bytes, local_server: LocalServer) -> None:
    env = {**local_server.env(), **AWS_ENV, "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "pandastack_jobs.queue.cli", "send", "--broker", broker.url(queue)],
        input=body,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]


def test_deep_json_is_dead_lettered_and_the_consumer_goes_on(
    broker: Broker, queue: str, start_consumer: Any, local_server: LocalServer
) -> None:
    """200,000 levels of nested JSON (400 KB; SQS refuses over 256 KiB, so 120,000 there), sent
    with `pandastack-jobs send`: dead-lettered `malformed`, field `body`, naming the depth limit;
    the other tenant's message beside it is acked. On the old code `RecursionError` escaped the
    parser and stopped the consumer (and every consumer after it)."""
    levels = 120_000 if broker.name == "sqs" else 200_000
    deep = b'{"command": "true", "tenant": "attacker", "input": ' + b"[" * levels + b"]" * levels + b"}"
    _send_cli(broker, queue, deep, local_server)
    broker.transport(queue).send(_msg(_result_job("fine"), id="other", tenant="victim"))
    stats = start_consumer(until=lambda s: s.acked >= 1 and s.dead_lettered >= 1).join(60)
    (dead,) = broker.dead(queue)
    assert dead["why"]["kind"] == "malformed" and dead["why"]["field"] == "body", dead["why"]
    assert "MAX_JSON_DEPTH" in dead["why"]["reason"] and "nested" in dead["why"]["reason"], dead["why"]
    (result,) = broker.results(queue)
    assert result["id"] == "other" and result["result"] == {"v": "fine", "delivery": 1}
    assert stats.acked == 1 and stats.dead_lettered == 1 and broker.depth(queue) == 0


def _forge(broker: Broker, queue: str) -> tuple[list[str | None], list[str]]:
    """Put the broker-level forgeries of this broker on the queue. Returns the fields the dead
    letters must name and the ids of the forged messages that must run as delivery 1 under
    their own broker id (a forgery the consumer ignores)."""
    good = lambda i: _msg(_result_job(i), id=i, tenant="attacker")  # noqa: E731
    if broker.name == "redis":
        # Any producer that can XADD could set the consumer's old bookkeeping fields.
        broker.r.xadd(queue, {"body": good("prior-x"), "prior": "x"})
        broker.r.xadd(queue, {"body": good("prior-neg"), "prior": "-100"})
        broker.r.xadd(queue, {"body": good("mid"), "mid": "1-1"})
        return ["prior", "prior", "mid"], []
    if broker.name == "rabbitmq":
        import pika

        ch = broker._channel()
        forgeries = [
            ({"x-pandastack-prior": "x"}, None, "prior-x"),
            ({"x-pandastack-mid": "victim"}, None, "mid"),
            ({"x-delivery-count": 99}, "victim", "count"),  # neither is read: ignored
        ]
        for headers, mid, i in forgeries:
            props = pika.BasicProperties(delivery_mode=2, headers=headers, message_id=mid)
            ch.basic_publish("", queue, good(i), props)
        ch.close()
        return ["headers.x-pandastack-prior", "headers.x-pandastack-mid"], ["count"]
    if broker.name == "sqs":
        attrs = {
            name: {"DataType": "String", "StringValue": value}
            for name, value in (("prior", "x"), ("mid", "victim"), ("ApproximateReceiveCount", "99"))
        }
        url = broker.client.get_queue_url(QueueName=queue)["QueueUrl"]  # type: ignore[attr-defined]
        broker.client.send_message(  # type: ignore[attr-defined]
            QueueUrl=url, MessageBody=good("attrs").decode(), MessageAttributes=attrs
        )
        return [], ["attrs"]
    if broker.name == "kafka":
        # Any producer can set record headers; on the main topic none is read as bookkeeping (the
        # retry topic's mid/count/not-before are the consumer's): it runs as delivery 1.
        assert isinstance(broker, Kafka)
        broker.produce(queue, good("headers"), headers={"mid": "victim", "count": "99", "not_before": "x"})
        return [], ["headers"]
    # PostgreSQL: a producer with INSERT on the whole table could set the consumer's columns.
    import psycopg

    with psycopg.connect(broker.url(queue).split("?")[0], autocommit=True) as conn:
        insert = "INSERT INTO pandastack_queue (queue, message_id, body, deliveries) VALUES (%s, %s, %s, %s)"
        conn.execute(insert, (queue, "victim", good("negative"), -100))
        conn.execute(insert, (queue, "victim", good("overflow"), 2**31 - 1))
    return [None], ["negative"]


def test_forged_bookkeeping_is_never_the_consumers(broker: Broker, queue: str, start_consumer: Any) -> None:
    """What a producer can write beside the body (Redis entry fields, AMQP headers and
    message_id, SQS message attributes, PostgreSQL columns) is never read as the message's
    identity or delivery count: the consumer keeps running, a forgery it does not read runs as
    delivery 1 under its own broker id, one it refuses is dead-lettered naming the field, and the
    other tenant's message is acked. On the old code `prior: x` (Redis) and `x-pandastack-prior:
    x` (RabbitMQ) raised out of receive() and stopped the consumer, a negative count ran as a
    negative delivery, and the PostgreSQL count overflowed inside receive()."""
    t = broker.transport(queue)
    t.send(_msg(_result_job("before"), id="victim-before", tenant="victim"))
    dead_fields, ignored = _forge(broker, queue)
    t.send(_msg(_result_job("after"), id="victim-after", tenant="victim"))
    want_acked = 2 + len(ignored)
    stats = start_consumer(
        until=lambda s: s.acked >= want_acked and s.dead_lettered >= len(dead_fields), max_deliveries=3
    ).join(60)
    results = {r["id"]: r for r in broker.results(queue)}
    assert set(results) == {"victim-before", "victim-after", *ignored}, results
    for r in results.values():
        assert r["result"]["delivery"] == 1, r
        # The forged ids (Redis's forged `mid` is "1-1"; on Kafka "1-1" is a real partition-offset).
        assert r["broker_id"] not in ("victim", *(("1-1",) if broker.name == "redis" else ())), r
    dead = broker.dead(queue)
    assert sorted(str(d["why"]["field"]) for d in dead) == sorted(str(f) for f in dead_fields), dead
    for d in dead:
        if d["why"]["field"] is not None:
            assert d["why"]["kind"] == "malformed" and d["why"]["reason"].startswith(d["why"]["field"])
        else:  # PostgreSQL: a count out of any sane range is past max_deliveries
            assert d["why"]["kind"] == "max_deliveries", d
    assert stats.acked == want_acked and broker.depth(queue) == 0


def test_a_reply_carries_the_tenant_and_the_broker_id(
    broker: Broker, queue: str, start_consumer: Any
) -> None:
    """Two messages of one tenant with one id run independently: two replies, same id and tenant,
    two broker ids; `$QUEUE_BROKER_ID` is the reply's broker id."""
    t = broker.transport(queue)
    job = 'printf \'{"broker": "%s"}\' "$QUEUE_BROKER_ID" > "$JOB_RESULT"'
    for _ in range(2):
        t.send(_msg(job, id="dup", tenant="t1"))
    start_consumer(until=lambda s: s.acked >= 2, concurrency=2).join(60)
    results = broker.results(queue)
    assert [(r["id"], r["tenant"]) for r in results] == [("dup", "t1"), ("dup", "t1")]
    assert len({r["broker_id"] for r in results}) == 2
    assert all(r["result"] == {"broker": r["broker_id"]} for r in results), results
    assert broker.depth(queue) == 0


@pytest.mark.parametrize("broker", ["postgres"], indirect=True)
def test_row_ids_of_two_tables_are_two_messages(
    broker: Broker, queue: str, local_server: LocalServer
) -> None:
    """PostgreSQL row ids restart in every table: a queue of one name in two tables (two
    products on one database, one PandaStack key) has a row 1 in each. The failing row 1 of one
    table, redelivered, must not reap the running row 1 of the other (the key carries the table).
    Seen failing before the key had the table: the victim ran twice."""
    import psycopg

    from pandastack_jobs import ConnectionConfig
    from pandastack_jobs.queue import Consumer
    from tests.queue.conftest import Running

    tables = [f"t{uuid.uuid4().hex[:8]}" for _ in range(2)]
    conn = ConnectionConfig(api_url=local_server.url, api_key=local_server.api_key)
    forged = f'[ "$QUEUE_DELIVERY" -ge 2 ] || exit 1; {_result_job("other table")}'
    runs = []
    for table, body in zip(tables, (_result_job("genuine", sleep=4), forged), strict=True):
        t = broker.transport(f"{queue}&table={table}")  # the fixture's URL ends in ?queue=...
        t.send(_msg(body, id="order-1", tenant=table))
        kw: dict[str, Any] = {"defaults": {"template": "base", "timeout": 30}, "release_delay": 0.2}
        consumer = Consumer(broker.transport(f"{queue}&table={table}"), conn, poll_seconds=0.2, **kw)
        runs.append(Running(consumer, lambda s: s.acked >= 1))
        if not runs[1:]:
            wait_for(
                "the victim's sandbox", lambda: live_sandboxes(local_server, tenant=tables[0]), timeout=60
            )
    for r in runs:
        r.join(90)
    dsn = broker.url(queue).split("?")[0]
    with psycopg.connect(dsn, autocommit=True) as db:
        (victim,) = [json.loads(bytes(b)) for (b,) in db.execute(f"SELECT body FROM {tables[0]}_results")]
        (other,) = [json.loads(bytes(b)) for (b,) in db.execute(f"SELECT body FROM {tables[1]}_results")]
    assert victim["broker_id"] == other["broker_id"] == "1"  # the same row id in each table
    assert victim["result"] == {"v": "genuine", "delivery": 1}, victim  # never reaped
    assert other["result"] == {"v": "other table", "delivery": 2}, other


@pytest.mark.parametrize("broker", ["postgres", "redis"], indirect=True)
def test_an_oversized_row_is_refused_without_reading_its_body(broker: Broker, queue: str) -> None:
    """Red team (issue 33): the body bound (``max_message_bytes``) was applied after the receive had
    read the whole row or stream entry: a producer's 30 MB row cost the consumer 180 MB of memory
    (a bytea may be 1 GB), and 3 x 40 MB entries on Redis +282 MB. The receive now leaves a body
    over the transport's bound on the broker (PostgreSQL: a CASE in the UPDATE ... RETURNING;
    Redis: the receive's Lua script empties it), hands out its size and marks it malformed
    (field ``body``); the dead letter still keeps the whole body, copied on the broker's side.
    Seen failing before: the delivery carried all 4 MiB (Redis: malformed was None)."""
    t = broker.transport(queue)
    t.max_body_bytes = 1 << 20
    t.send(b"x" * (4 << 20))
    t.send(_msg("true", id="small"))
    got = {d.body == b"": d for d in t.receive(10, 5)}
    big, small = got[True], got[False]
    assert big.malformed is not None and big.malformed[0] == "body", big.malformed
    assert "4194304 bytes" in big.malformed[1] and "1048576" in big.malformed[1]
    assert small.malformed is None and json.loads(small.body)["id"] == "small"
    from pandastack_jobs.queue import DeadLetter

    t.dead_letter(big, DeadLetter(f"body: {big.malformed[1]}", "malformed", "body", 1))
    (dead,) = broker.dead(queue)
    assert len(dead["body"]) == 4 << 20 and dead["why"]["field"] == "body"


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_an_entry_of_many_fields_each_under_the_bound_is_not_read_whole(broker: Broker, queue: str) -> None:
    """Red team: the Redis receive bounded each field, not the entry: 100 fields of 900 KB (each
    under the 1 MiB bound) were read whole into the consumer (about 180 MB for one entry). Now the
    entry's fields together are bounded: past it every value stays on the broker and the entry is
    malformed. Seen failing before: the delivery carried its body and its 20 fields of 900 KB
    (malformed only for the extra field's name)."""
    import redis

    t = broker.transport(queue)
    t.max_body_bytes = 1 << 20
    r = redis.Redis.from_url(broker.url(queue).split("?")[0])
    fields = {"body": b"{}", **{f"f{i}": b"x" * (900 << 10) for i in range(20)}}
    r.xadd(queue, fields)
    (d,) = t.receive(10, 5)
    assert d.malformed is not None and d.body == b"", (d.malformed, len(d.body))


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_stream_at_its_last_possible_id_loses_no_released_message(broker: Broker, queue: str) -> None:
    """Red team: one ``XADD <stream> <max id>`` (allowed by ``+xadd``) makes every later XADD on
    the stream fail; the release script settled the entry before its XADD failed (Lua does not
    roll back), so a released message was lost: not in the stream, the pending list or the
    delayed set. Now the re-add comes first: when it fails, nothing of the message was touched
    (the release raises; the entry stays pending and is delivered again). Seen failing before:
    the entry was gone from the pending list."""
    import redis

    t = broker.transport(queue)
    t.send(_msg("true", id="honest"))
    (d,) = t.receive(10, 5)
    r = redis.Redis.from_url(broker.url(queue).split("?")[0])
    r.execute_command("XADD", queue, "18446744073709551615-18446744073709551615", "body", "{}")
    with pytest.raises(redis.ResponseError, match="last possible"):
        t.release(d, 0)
    pending = r.xpending(queue, t.group)
    assert pending["pending"] == 1, pending

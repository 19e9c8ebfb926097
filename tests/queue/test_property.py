"""A property of the consumer on each of the four real brokers (issue 33): whatever a producer puts
on the queue (arbitrary bodies, arbitrary broker-level fields, headers, properties, attributes
and columns), the consumer stays up and every well-formed message beside it settles exactly once.

The property is about the consumer's settling, so the jobs run on the in-memory PandaStack
(:class:`pandastack_jobs.testing.FakeClient`): a job takes milliseconds and hypothesis gets many
examples in a few seconds a broker. The brokers are real."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e.brokers import Broker
from pandastack_jobs.queue import Consumer
from pandastack_jobs.testing import FakeClient
from pandastack_local.testing.waiting import wait_for
from tests.queue.conftest import Running

pytestmark = pytest.mark.timeout(240)
EXAMPLES = 12  # about 0.3-0.6 s each on a loaded two-core machine


class _Fake(FakeClient):
    def close(self) -> None:
        """The consumer closes each job's client; this one is shared."""


class _FakeConnection:
    """What the consumer needs of a ConnectionConfig: a client per job."""

    def __init__(self) -> None:
        self.fake = _Fake()
        self.fake.script("well-formed-job", result={"ok": True})

    def client(self) -> FakeClient:
        return self.fake


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.text(max_size=20),
    st.lists(st.integers(-5, 5), max_size=3),
)
# Names the consumer has used, or the broker uses, for its own bookkeeping, and any other.
_RESERVED = ["prior", "mid", "body", "why", "x-pandastack-prior", "x-pandastack-mid", "x-pandastack-sig"]
_SQS_CHARS = st.characters(min_codepoint=0x20, max_codepoint=0xD7FF)


def _bodies() -> st.SearchStrategy[bytes]:
    doc = st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=10),
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
        max_leaves=8,
    )
    message = st.fixed_dictionaries(
        {"command": st.text(max_size=10) | st.integers()},
        optional={
            "id": st.text(max_size=12) | st.integers(),
            "tenant": st.text(max_size=12) | st.none(),
            "options": st.dictionaries(st.sampled_from(["timeout", "key", "metadata", "env"]), doc),
            "input": doc,
        },
    )
    nested = st.integers(1, 5000).map(lambda n: b'{"command": "x", "input": ' + b"[" * n + b"]" * n + b"}")
    return st.one_of(
        st.binary(max_size=200),
        st.text(max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass")),
        doc.map(lambda d: json.dumps(d).encode()),
        message.map(lambda d: json.dumps(d).encode()),
        nested,
    )


def _noise(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    """One hostile item: a body and what this broker lets a producer set beside it."""
    if kind == "redis":
        names = st.sampled_from([n.encode() for n in _RESERVED]) | st.binary(min_size=1, max_size=8)
        fields = st.dictionaries(names, st.binary(max_size=30), max_size=3)
        return st.fixed_dictionaries({"body": _bodies(), "fields": fields, "with_body": st.booleans()})
    if kind == "rabbitmq":
        names = st.sampled_from([*_RESERVED, "x-delivery-count", "x-death"]) | st.text(min_size=1, max_size=8)
        return st.fixed_dictionaries(
            {
                "body": _bodies(),
                "headers": st.dictionaries(names, _VALUES, max_size=4),
                "message_id": st.none() | st.text(max_size=20),
                "to_work": st.booleans(),  # straight into the consumers' own queue (no ACL set)
            }
        )
    if kind == "sqs":
        names = st.sampled_from(["prior", "mid", "ApproximateReceiveCount", "MessageId"]) | st.from_regex(
            r"\A[a-z][A-Za-z0-9_-]{0,15}\Z"
        )
        attrs = st.dictionaries(names, st.text(_SQS_CHARS, min_size=1, max_size=20), max_size=3)
        body = st.text(_SQS_CHARS, min_size=1, max_size=100) | _bodies().map(
            lambda b: b.decode("utf-8", "replace").replace("\x00", "?") or "-"
        )
        return st.fixed_dictionaries({"body": body, "attrs": attrs})
    if kind == "kafka":
        # Record headers a producer sets on the main topic (the retry topic's are the consumer's).
        names = st.sampled_from(["mid", "count", "not_before", "traceparent"]) | st.text(
            min_size=1, max_size=8
        )
        headers = st.dictionaries(names, st.binary(max_size=30), max_size=3)
        return st.fixed_dictionaries({"body": _bodies(), "headers": headers, "partition": st.integers(0, 1)})
    text = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=20)
    return st.fixed_dictionaries(
        {
            "body": _bodies(),
            "message_id": st.none() | text,
            "deliveries": st.none() | st.integers(-(2**31), 2**31 - 1),
        }
    )


def _put(broker: Broker, queue: str, item: dict[str, Any]) -> None:
    if broker.name == "redis":
        fields = dict(item["fields"])
        if item["with_body"] or not fields:
            fields[b"body"] = item["body"]
        broker.r.xadd(queue, fields)  # type: ignore[attr-defined]
    elif broker.name == "rabbitmq":
        import pika

        ch = broker._channel()  # type: ignore[attr-defined]
        props = pika.BasicProperties(headers=item["headers"], message_id=item["message_id"])
        ch.basic_publish("", f"{queue}.work" if item["to_work"] else queue, item["body"], props)
        ch.close()
    elif broker.name == "sqs":
        url = broker.client.get_queue_url(QueueName=queue)["QueueUrl"]  # type: ignore[attr-defined]
        attrs = {k: {"DataType": "String", "StringValue": v} for k, v in item["attrs"].items()}
        broker.client.send_message(QueueUrl=url, MessageBody=item["body"], MessageAttributes=attrs)  # type: ignore[attr-defined]
    elif broker.name == "kafka":
        from confluent_kafka import Producer

        p = Producer({"bootstrap.servers": f"127.0.0.1:{broker.port}"})  # type: ignore[attr-defined]
        p.produce(
            queue, value=item["body"], partition=item["partition"], headers=list(item["headers"].items())
        )
        assert p.flush(10) == 0
    else:
        import psycopg

        cols = {"queue": queue, "body": item["body"]}
        for name in ("message_id", "deliveries"):
            if item[name] is not None:
                cols[name] = item[name]
        query = f"INSERT INTO pandastack_queue ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))})"
        with psycopg.connect(broker.url(queue).split("?")[0], autocommit=True) as conn:
            conn.execute(query, tuple(cols.values()))  # type: ignore[arg-type]


def test_no_message_stops_the_consumer_and_every_good_one_settles_once(broker: Broker, queue: str) -> None:
    transport = broker.transport(queue, 5.0)
    conn = _FakeConnection()
    consumer = Consumer(
        transport,
        conn,  # type: ignore[arg-type]
        defaults={"template": "base", "timeout": 30},
        concurrency=4,
        max_deliveries=2,
        release_delay=0.1,
        poll_seconds=0.1,
    )
    running = Running(consumer, None)
    sent: list[str] = []
    producer = broker.transport(queue)

    noise = st.lists(_noise(broker.name), min_size=1, max_size=4)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(noise=noise, good=st.integers(1, 3), data=st.data())
    def example(noise: list[dict[str, Any]], good: int, data: st.DataObject) -> None:
        ids = [f"good-{uuid.uuid4().hex[:12]}" for _ in range(good)]
        items: list[Any] = [*noise, *ids]
        order = data.draw(st.permutations(items))
        for item in order:
            if isinstance(item, str):
                producer.send(json.dumps({"id": item, "command": "echo well-formed-job"}).encode())
            else:
                _put(broker, queue, item)
        sent.extend(ids)
        wait_for(
            "the well-formed messages' replies",
            lambda: {r["id"] for r in broker.results(queue)},
            timeout=30,
            interval=0.05,
            check=lambda got: set(ids) <= got,
            abort=lambda: None if running.thread.is_alive() else f"the consumer stopped: {running.error!r}",
        )
        assert running.thread.is_alive(), running.error

    try:
        example()
        wait_for("an empty queue", lambda: broker.depth(queue), timeout=60, check=lambda n: n == 0)
    finally:
        consumer.stop()
        running.join(60)
    replies = Counter(r["id"] for r in broker.results(queue))
    assert all(replies[i] == 1 for i in sent), {i: replies[i] for i in sent if replies[i] != 1}
    assert consumer.stats.acked >= len(sent)

"""A record the broker refuses for ITSELF (too large for its topic) is not a broker outage: the
Kafka transport raises :class:`RecordRejected` for it, and the consumer dead-letters the message
at once instead of reconnecting with it held at the head of its settle queue (which stalled
every tenant's settling). tests/queue/test_kafka.py holds it on Apache Kafka."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from pandastack_jobs.queue import Consumer
from pandastack_jobs.queue.kafka import KafkaTransport
from pandastack_jobs.queue.memory import MemoryTransport
from pandastack_jobs.queue.transport import BrokerUnavailable, DeadLetter, Delivery, LeaseLost, RecordRejected
from pandastack_jobs.testing import FakeClient
from pandastack_local.testing.waiting import wait_for
from tests.unit.core.test_queue_chunks import _Fake
from tests.unit.core.test_queue_kafka_offsets import _Clock, _RetryLane, _stepped

_LIMIT = 1_000_000  # librdkafka's message.max.bytes by default


class _Bounded(_RetryLane):
    """The producer (and the retry topic) with librdkafka's client-side size check; a refusal in
    the delivery report instead when ``in_report`` (the broker's answer), and ``down`` makes
    every produce a transport failure."""

    def __init__(self, transport: KafkaTransport, clock: _Clock, in_report: bool = False) -> None:
        super().__init__(transport, clock, lag=0.0)
        self.in_report = in_report
        self.down = False

    def produce(
        self, topic: str, value: bytes, key: bytes | None, headers: list[Any], on_delivery: Any
    ) -> None:
        if self.down:
            on_delivery(KafkaError(KafkaError._TRANSPORT, "Connection refused"), None)
            return
        size = len(value) + len(key or b"") + sum(len(k) + len(v) for k, v in headers)
        if size > _LIMIT:
            err = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Broker: Message size too large")
            if not self.in_report:
                raise KafkaException(err)
            on_delivery(err, None)
            return
        super().produce(topic, value, key, headers, on_delivery)


def _taken(
    monkeypatch: pytest.MonkeyPatch, key: bytes, in_report: bool = False
) -> tuple[KafkaTransport, _Bounded, Delivery]:
    """A transport holding one delivery of ``jobs[0]`` at offset 0, whose record key is ``key``
    (the fake's record value carries the key too)."""
    t, _, clock = _stepped(monkeypatch, "kafka://127.0.0.1:1?topic=jobs&group=g", {0: [key]})
    lane = _Bounded(t, clock, in_report)
    t._consumers[t.retry_topic] = t._producer = lane  # type: ignore[assignment]
    (first,) = t.receive(4, 0.3)
    return t, lane, first


@pytest.mark.parametrize("in_report", [False, True])
def test_a_record_refused_for_its_size_is_rejected_not_an_outage(
    monkeypatch: pytest.MonkeyPatch, in_report: bool
) -> None:
    """Seen failing before the fix: BrokerUnavailable (the consumer reconnected for ever)."""
    t, lane, first = _taken(monkeypatch, b"k")
    lane.in_report = in_report
    with pytest.raises(RecordRejected) as caught:
        t.reply(b"r" * 1_200_000)
    text = str(caught.value)
    assert caught.value.size == 1_200_000 and not isinstance(caught.value, BrokerUnavailable)
    assert "jobs.results" in text and "1200000 bytes" in text
    assert "max.message.bytes" in text and "message.max.bytes" in text
    with pytest.raises(RecordRejected, match=r"jobs\.retry refused a record of 1000\d\d\d bytes"):
        t.release(Delivery(first.message_id, b"x" * 1_000_000, first.count, first.handle), 0)
    lane.down = True  # the connection, not the record: still an outage
    with pytest.raises(BrokerUnavailable):
        t.reply(b"small")


@pytest.mark.parametrize("key", [b"k", b"k" * 1_030_000])
def test_a_dead_letter_too_large_to_keep_whole_is_kept_without_its_body_and_settled(
    monkeypatch: pytest.MonkeyPatch, key: bytes
) -> None:
    """A ~1 MB body (or key) plus its reason: dead-lettered once without them, the reason naming
    their sizes and where the original is, and the offset committed past it. Seen failing before
    the fix: BrokerUnavailable, nothing dead-lettered, the offset left open."""
    t, lane, first = _taken(monkeypatch, key)
    big = Delivery(first.message_id, b"x" * 1_030_000, first.count, first.handle)
    t.dead_letter(big, DeadLetter("the body is over the limit", "malformed", "body", 1))
    (dead,) = [rec for _, rec in lane.records if rec.topic() == t.dead_topic]
    assert dead.value() == b"" and dead.key() is None
    why = json.loads(dict(dead.headers())["why"])
    assert why["kind"] == "malformed" and why["field"] == "body"
    assert why["reason"].startswith("[not kept: the body of 1030000 bytes")
    assert why["reason"].endswith("] the body is over the limit")
    assert "1030000 bytes" in why["reason"] and f"key of {len(key)} bytes" in why["reason"]
    assert "jobs[0] at offset 0" in why["reason"] and "max.message.bytes" in why["reason"]
    part = t._parts[("jobs", 0)]
    assert part.open == set() and part.committed == 1


class _Sized(MemoryTransport):
    """The in-memory queue with Kafka's size limit on what it publishes: a result or a retry
    record over ``limit`` is refused as the Kafka transport refuses it."""

    limit = 100_000

    def reply(self, body: bytes) -> None:
        if len(body) > self.limit:
            raise RecordRejected(f"jobs.results refused a record of {len(body)} bytes", size=len(body))
        super().reply(body)

    def release(self, delivery: Delivery, delay_seconds: float) -> None:
        if len(delivery.body) > self.limit:
            raise RecordRejected(f"jobs.retry refused a record of {len(delivery.body)} bytes", size=1)
        super().release(delivery, delay_seconds)


def _consume(fake: FakeClient, t: _Sized, done: Any) -> Consumer:
    c = Consumer(t, _Fake(fake), concurrency=2, max_deliveries=3, release_delay=0, poll_seconds=0.05)
    thread = threading.Thread(target=c.run, daemon=True)
    thread.start()
    try:
        wait_for("the messages settled", done, timeout=20, interval=0.01)
    finally:
        c.stop()
        thread.join(30)
    assert not thread.is_alive(), c.stats
    return c


def test_a_result_too_large_for_the_reply_topic_is_dead_lettered_at_once(fake: FakeClient) -> None:
    """Seen failing before the fix (with RecordRejected raised): released and re-run three times,
    then dead-lettered as max_deliveries with the sink's error."""
    t = _Sized()
    fake.script("big", result={"p": "a" * 200_000})
    fake.script("echo", result={"fine": True})
    t.put({"id": "evil", "command": "big", "tenant": "attacker"})
    for i in range(3):
        t.put({"id": f"victim{i}", "command": "echo", "tenant": "victim"})
    c = _consume(fake, t, lambda: len(t.acked) == 3 and t.dead)
    ((_, why),) = t.dead
    assert why.kind == "reply_rejected" and why.deliveries == 1 and t.released == []
    assert "200" in why.reason and "re-running the job would give the same result" in why.reason
    assert sorted(r["id"] for r in t.replies) == ["victim0", "victim1", "victim2"]
    assert c.stats.reconnects == 0


def test_a_release_refused_for_its_size_is_dead_lettered_at_once(fake: FakeClient) -> None:
    """A ~1 MB message that fails (exit 1): its retry record is refused; seen failing before the
    fix: left unsettled ("could not be settled"), never dead-lettered."""
    t = _Sized()
    fake.script("exit", exit_code=1)
    fake.script("echo", result={"fine": True})
    t.put({"id": "evil", "command": "exit", "options": {"env": {"PAD": "x" * 150_000}}})
    t.put({"id": "victim", "command": "echo"})
    c = _consume(fake, t, lambda: t.acked and t.dead)
    ((_, why),) = t.dead
    assert why.kind == "release_rejected" and "jobs.retry refused a record" in why.reason
    assert c.stats.reconnects == 0 and t.acked


def test_sqs_refusing_a_result_for_its_size_is_a_rejected_record() -> None:
    """SQS (and moto) answer InvalidParameterValue "Message must be shorter than N bytes"; seen
    failing before the fix: the ClientError (released, re-run, dead-lettered as max_deliveries)."""
    import botocore.exceptions

    from pandastack_jobs.queue.sqs import SQSTransport

    class _Client:
        def __init__(self, message: str) -> None:
            self.message = message

        def send_message(self, QueueUrl: str, MessageBody: str) -> None:
            error = {"Error": {"Code": "InvalidParameterValue", "Message": self.message}}
            raise botocore.exceptions.ClientError(error, "SendMessage")  # type: ignore[arg-type]

    t = SQSTransport("sqs://jobs?region=us-east-1")
    t.urls = {"results": "http://sqs/jobs-results"}
    t._client = _Client(
        "One or more parameters are invalid. Reason: Message must be shorter than 1048576 bytes."
    )
    with pytest.raises(
        RecordRejected, match=r"jobs-results refused a result of 1200000 bytes.*MaximumMessageSize"
    ):
        t.reply(b"r" * 1_200_000)
    t._client = _Client("Invalid request: DelaySeconds")  # another refusal stays what it was
    with pytest.raises(botocore.exceptions.ClientError):
        t.reply(b"r")


def _give_back(fake: FakeClient, t: MemoryTransport, why: str) -> Consumer:
    """One slot, three messages of three tenants pulled for chunks of four: ``first`` runs (held
    until the end), ``big`` (~150 KB) and ``small`` wait; then the consumer gives back what it
    pulled: on a drain (``stop()``), or when PandaStack goes down (every create refused as a
    connection error). Returns the consumer once its loop ended, asserting it raised nothing."""
    import pandastack

    gate = threading.Event()
    fake.script("slow", wait=gate, result={"fine": True})
    fake.script("echo", result={"fine": True})
    if why == "outage":
        fake.fail("create", pandastack.APIConnectionError("Connection refused"), times=None)
    t.put({"id": "first", "command": "slow", "tenant": "a"})
    t.put({"id": "big", "command": "echo", "tenant": "b", "options": {"env": {"PAD": "x" * 150_000}}})
    t.put({"id": "small", "command": "echo", "tenant": "c"})
    c = Consumer(
        t,
        _Fake(fake),
        concurrency=1,
        chunk_size=4,
        chunk_key="tenant",
        max_deliveries=3,
        release_delay=0,
        poll_seconds=0.05,
    )
    errors: list[BaseException] = []

    def run() -> None:
        try:
            c.run()
        except BaseException as exc:  # the assertion below names it
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        if why == "drain":
            wait_for("the first job runs", lambda: fake.live(), timeout=10, interval=0.01)
            c.stop()
        wait_for(
            "big given back",
            lambda: "big" not in [w.delivery.message_id for w in c._pending] or errors,
            timeout=10,
            interval=0.01,
        )
        wait_for("small given back", lambda: "small" in t.released or errors, timeout=10, interval=0.01)
    finally:
        gate.set()
        c.stop()
        thread.join(30)
    assert not errors, errors
    assert not thread.is_alive(), c.stats
    return c


@pytest.mark.parametrize("why", ["drain", "outage"])
def test_a_pulled_message_whose_give_back_is_refused_is_dead_lettered_never_a_crash(
    fake: FakeClient, why: str
) -> None:
    """The ~150 KB message's retry record is refused for its size. Seen failing before the fix:
    RecordRejected escaped the loop and the consumer exited (and again after each restart that
    pulled it)."""
    t = _Sized()
    _give_back(fake, t, why)
    ((mid, dead),) = t.dead
    assert mid == "big" and dead.kind == "release_rejected", dead
    assert "jobs.retry refused a record" in dead.reason, dead


class _Flaky(MemoryTransport):
    """``big``'s give-back finds its lease gone; the first give-back of ``small`` finds the
    broker down (it is up again at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.downs = 0

    def release(self, delivery: Delivery, delay_seconds: float) -> None:
        if delivery.message_id == "big":
            raise LeaseLost("big: its lease ran out and another consumer took it")
        if delivery.message_id == "small" and self.downs == 0:
            self.downs += 1
            raise BrokerUnavailable("connection reset")
        super().release(delivery, delay_seconds)


@pytest.mark.parametrize("why", ["drain", "outage"])
def test_a_give_back_that_loses_its_lease_or_meets_an_outage_never_stops_the_loop(
    fake: FakeClient, why: str
) -> None:
    """Seen failing before the fix: LeaseLost escaped the loop (the consumer exited), and a
    give-back that met the broker down was counted as done though it never happened."""
    t = _Flaky()
    c = _give_back(fake, t, why)
    assert "big" not in t.released and t.dead == [], (t.released, t.dead)
    assert "small" in t.released and t.downs == 1 and c.stats.reconnects >= 1, (t.released, c.stats)

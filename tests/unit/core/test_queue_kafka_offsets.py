"""The Kafka transport's offset bookkeeping, without a broker: what it commits while messages of
one partition finish out of order (tests/queue/test_kafka.py holds it on Apache Kafka)."""

from __future__ import annotations

import json
import time

from confluent_kafka import KafkaError, TopicPartition

from pandastack_jobs.queue.kafka import _META_BYTES, KafkaTransport, _Part, _tenant


def test_the_commit_point_is_the_lowest_unsettled_offset_and_settled_ones_past_it_are_listed() -> None:
    part = _Part(epoch=1, committed=-1, high=0)
    for offset in range(5):
        part.open.add(offset)
        part.high = offset + 1
    assert part.commit_point() == 0
    for done in (1, 2, 4):  # finished out of order; 0 and 3 still run
        part.open.discard(done)
    assert part.commit_point() == 0
    assert part.settled_ranges() == [[1, 3], [4, 5]]
    part.open.discard(0)
    assert part.commit_point() == 3 and part.settled_ranges() == [[4, 5]]
    part.open.discard(3)
    assert part.commit_point() == 5 and part.settled_ranges() == []


def test_the_metadata_carries_the_starts_and_settled_ranges_and_stays_under_the_brokers_limit() -> None:
    part = _Part(epoch=1, committed=0, high=3, open={0, 2}, starts={0: 2, 2: 1})
    assert json.loads(part.metadata()) == {"starts": {"0": 2, "2": 1}, "settled": [[1, 2]]}
    many = _Part(epoch=1, committed=0, high=4000, open=set(range(0, 4000, 2)))
    many.starts = {o: 1 for o in many.open}
    text = many.metadata()
    assert len(text) <= _META_BYTES
    doc = json.loads(text)
    assert doc["settled"] == [] and doc["starts"]  # settled ranges give way first: a rerun, never a skip


def test_a_previous_owners_settled_ranges_are_skipped() -> None:
    part = _Part(epoch=2, committed=0, high=0, settled=[(1, 3)])
    assert [o for o in range(5) if part.was_settled(o)] == [1, 2]


def test_the_default_key_is_the_messages_tenant() -> None:
    assert _tenant(b'{"tenant": "acme", "command": "x"}') == "acme"
    for body in (b'{"command": "x"}', b'{"tenant": 5}', b'{"tenant": ""}', b"[1]", b"not json"):
        assert _tenant(body) is None


class _FakeRecord:
    """What ``Consumer.consume`` hands over: a record, or a partition's end (an event)."""

    def __init__(self, topic: str, partition: int, offset: int, value: bytes | None = None) -> None:
        self._at = (topic, partition, offset)
        self._value = value

    def error(self) -> KafkaError | None:
        return KafkaError(KafkaError._PARTITION_EOF) if self._value is None else None

    def topic(self) -> str:
        return self._at[0]

    def partition(self) -> int:
        return self._at[1]

    def offset(self) -> int:
        return self._at[2]

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> None:
        return None

    def headers(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return (0, 0)


class _SlowFirstFetch:
    """A consumer of a loaded broker: the group assigns two partitions at once, and their first
    fetch answers ``fetch_after`` seconds later (a record on partition 0, the end of 1, then of 0)."""

    def __init__(self, transport: KafkaTransport, topic: str, fetch_after: float) -> None:
        self.transport, self.topic, self.fetch_after = transport, topic, fetch_after
        self.assigned_at: float | None = None
        self.fetched = False

    def consume(self, n: int, timeout: float) -> list[_FakeRecord]:
        if self.topic == self.transport.retry_topic:
            return []
        if self.assigned_at is None:
            self.assigned_at = time.monotonic()
            self.transport._on_assign(self, [TopicPartition(self.topic, 0), TopicPartition(self.topic, 1)])  # type: ignore[arg-type]
        wait = self.assigned_at + self.fetch_after - time.monotonic()
        if wait > 0:
            time.sleep(min(wait, timeout))
            return []
        if self.fetched:
            time.sleep(timeout)
            return []
        self.fetched = True
        return [
            _FakeRecord(self.topic, 0, 0, b'{"id": "first", "command": "true"}'),
            _FakeRecord(self.topic, 1, 0),
            _FakeRecord(self.topic, 0, 1),
        ]

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, -1001) for tp in partitions]

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(self.topic, 0), TopicPartition(self.topic, 1)]

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> list[TopicPartition]:
        return offsets

    def pause(self, tps: list[TopicPartition]) -> None:
        pass

    def resume(self, tps: list[TopicPartition]) -> None:
        pass


def test_an_assigned_partition_not_fetched_yet_is_not_an_idle_queue() -> None:
    """The engines' batches end on an empty receive. Right after the group's assignment, on a
    loaded broker, the first fetch can take seconds: a receive then must wait for it (up to the
    join's bound), not answer "empty" (CI: a Prefect flow on Kafka received 0 of 3 messages;
    seen failing before: [] after 0.5 s)."""
    t = KafkaTransport("kafka://127.0.0.1:1?topic=jobs&group=g")
    for topic in (t.topic, t.retry_topic):
        t._consumers[topic] = _SlowFirstFetch(t, topic, fetch_after=1.5)  # type: ignore[assignment]
    started = time.monotonic()
    got = t.receive(10, 0.5)
    assert [d.message_id for d in got] == ["0-0"], got
    assert 1.4 < time.monotonic() - started < 5
    # Once every partition was fetched, an empty receive is an idle queue: it waits its own time,
    # also after a rebalance hands over a partition not fetched yet (the consumer's loop, which
    # settles finished jobs and hears SIGTERM between receives, is never held 30 s).
    for _ in range(2):
        started = time.monotonic()
        assert t.receive(10, 0.3) == []
        assert time.monotonic() - started < 1.5
        t._on_assign(t._consumers[t.topic], [TopicPartition(t.topic, 2)])

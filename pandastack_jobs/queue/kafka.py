"""Apache Kafka through confluent-kafka (librdkafka): a consumer group, manual offset commits after
the result, a consumer-owned retry topic, a dead-letter topic and a reply topic.

Offsets, not messages, are acked in Kafka, and jobs of one partition finish out
of order: the transport keeps, per assigned partition, the offsets it has taken
and not yet settled, and commits the lowest of them (or one past the highest
taken, when none is open): the committed offset never passes an unsettled
message, so a consumer killed mid-job leaves its messages to the next owner.

The commit also carries, in its metadata (which only a group member can write),
how often each open offset was started: the next owner's delivery count. A
release publishes the message to ``<topic>.retry`` with its broker id, its
count so far and a not-before time in headers, signed as RabbitMQ's stamps are
(``stamps.py``: HMAC under a key only consumers hold; a record there whose
signature does not verify is dead-lettered naming the header ``sig``, and its
not-before is not obeyed), then settles the original; a retry
partition whose head is not yet due is paused and resumed when due, so the
main partitions never wait. Dead letters go to ``<topic>.dead`` (the original
key and value, the reason in the ``why`` header), results to ``<topic>.results``.

A rebalance revokes partitions between two polls of the loop thread: the
transport forgets them at once, so :meth:`KafkaTransport.lost` is true for
their deliveries (the consumer cancels those jobs and settles nothing of them)
and no offset of theirs is committed by this member afterwards.

With ``order=key`` the messages of one record key (e.g. the tenant) run one at
a time in offset order, and a release waits here, uncommitted, instead of going
to the retry topic: other keys go on, this key waits for its retry.
docs/queues.md ("Kafka") has the semantics in full.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from ..tracing import valid_traceparent
from .message import DEFAULT_MAX_MESSAGE_BYTES
from .stamps import MAX_PRIOR, Stamper
from .transport import (
    MAX_DEAD_LETTER_BYTES,
    BrokerUnavailable,
    DeadLetter,
    DeadLetterRecord,
    Delivery,
    LeaseLost,
    RecordRejected,
    Transport,
    body_string,
)

logger = logging.getLogger(__name__)

_LIBRDKAFKA_LOG = logger.getChild("librdkafka")  # the same name, from the module's logger
_META_BYTES = 3500  # the broker keeps at most offset.metadata.max.bytes (4096 by default)
# What a retry record or a dead letter adds to a message the consumer took: the stamps and the
# trace headers, or the dead letter's reason (at most MAX_DEAD_LETTER_BYTES) and its id.
_RECORD_HEADROOM = MAX_DEAD_LETTER_BYTES + 64 * 1024
_PREFETCH = 64  # records taken from Kafka and not yet handed out, at most (then the partitions pause)
_FLUSH_SECONDS = 10.0
# What a group coordinator answers while it is not ready yet (asked again by ``backlog``).
_COORDINATOR_BUSY = ("Coordinator load in progress", "Coordinator not available", "Not coordinator")
_EVENT_ROUNDS = 4  # consume() calls one receive makes for the places events took in a batch
_JOIN_SECONDS = 30.0  # how long the first receive waits for the first assignment (a loaded join: >10 s)
_RETURN_SECONDS = 5.0  # how long past its due an empty receive waits for a release of ours to come back
# A commit that fails with these means the partition is no longer ours (a rebalance).
_FENCED = frozenset(
    {
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError.REBALANCE_IN_PROGRESS,
        KafkaError._ASSIGNMENT_LOST,
        KafkaError.FENCED_INSTANCE_ID,
        getattr(KafkaError, "STALE_MEMBER_EPOCH", -9999),
    }
)
_DOWN = frozenset({KafkaError._ALL_BROKERS_DOWN})
# What refuses one record, not the connection (from produce() or its delivery report): the same
# record is refused again, so it is :class:`RecordRejected`, never :class:`BrokerUnavailable`.
_REJECTED = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_RECORD,
    }
)
# Settings from the URL that only one kind of client takes (the others would warn about them).
_CONSUMER_ONLY = frozenset(
    {
        "session.timeout.ms",
        "heartbeat.interval.ms",
        "max.poll.interval.ms",
        "group.instance.id",
        "group.protocol",
        "auto.offset.reset",
        "fetch.min.bytes",
        "fetch.wait.max.ms",
        "fetch.max.bytes",
        "isolation.level",
    }
)
_PRODUCER_ONLY = frozenset({"linger.ms", "acks", "compression.type", "batch.size", "message.timeout.ms"})


# How often backlog() asks again after a retriable answer, half a second apart.
BACKLOG_ATTEMPTS = 6


@dataclass
class _Ref:
    """The handle of one delivery: which record of which ownership of its partition."""

    topic: str
    partition: int
    offset: int
    epoch: int
    key: bytes | None
    prior: int  # deliveries before this record existed (a retry record's count so far)
    message_id: str
    # Producer-written, read as untrusted (the metrics and traces validate them again): when the
    # message was first sent (epoch seconds), and its W3C trace context (valid, else None).
    sent: str | None = None
    traceparent: str | None = None
    malformed: tuple[str, str] | None = None  # a retry record without a consumer's stamp


@dataclass
class _Record:
    ref: _Ref
    value: bytes
    due: float = 0.0  # order=key: a held release waits until this time.time()


@dataclass
class _Part:
    """One assigned partition: the offsets taken and not settled, and the starts to commit."""

    epoch: int
    committed: int  # the offset last committed by us (or found committed)
    high: int  # one past the highest offset taken
    open: set[int] = field(default_factory=set)
    starts: dict[int, int] = field(default_factory=dict)  # open offset -> deliveries started
    settled: list[tuple[int, int]] = field(default_factory=list)  # [a, b) past the point, done before

    def was_settled(self, offset: int) -> bool:
        return any(a <= offset < b for a, b in self.settled)

    def settled_ranges(self) -> list[list[int]]:
        """The offsets past the commit point that are settled, as ``[a, b)`` ranges (between
        the open ones: at most one more range than open offsets)."""
        out: list[list[int]] = []
        for lo, hi in itertools.pairwise([*sorted(self.open), self.high]):
            if hi > lo + 1:
                out.append([lo + 1, hi])
        return out

    def commit_point(self) -> int:
        return min(self.open) if self.open else self.high

    def metadata(self) -> str:
        point = self.commit_point()
        starts = {str(o): n for o, n in sorted(self.starts.items()) if o >= point}
        settled = self.settled_ranges()
        doc = {"starts": starts, "settled": settled}
        text = json.dumps(doc, separators=(",", ":"))
        while len(text) > _META_BYTES and (settled or starts):
            # Too many open offsets to say it all: a settled message may run again, a count
            # may start lower; never the other way round.
            if settled:
                settled.pop()
            else:
                starts.pop(next(iter(starts)))
            text = json.dumps(doc, separators=(",", ":"))
        return text


class KafkaTransport(Transport):
    """``kafka://host:port[,host:port]?topic=jobs&group=pandastack`` (more in docs/queues.md).

    ``partitions`` (default 4) is used only when the transport creates its topics; ``order=key``
    keeps one record key's messages in order; any other query key with a dot in it
    (``security.protocol``, ``sasl.mechanism``, ``session.timeout.ms``...) goes to librdkafka.
    """

    lease_seconds: float | None = None  # the group membership is the lease: no per-message extension

    def __init__(self, url: str, lease_seconds: float | None = None, secret: str | None = None) -> None:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.topic = query.pop("topic", "pandastack-jobs")
        self.group = query.pop("group", "pandastack")
        self.name = self.topic
        try:
            self.partitions = int(query.pop("partitions", "4"))
        except ValueError:
            raise ValueError("kafka URL: partitions must be an integer, e.g. partitions=4") from None
        order = query.pop("order", "")
        if order not in ("", "key"):
            raise ValueError(f"kafka URL: order={order!r} is not 'key' (or leave it out)")
        self.ordered = order == "key"
        self._stamps = Stamper(self.topic, secret)  # the retry topic's headers (module docstring)
        self.retry_topic, self.dead_topic, self.reply_topic = (
            f"{self.topic}.retry",
            f"{self.topic}.dead",
            f"{self.topic}.results",
        )
        self._hosts = parts.netloc.rsplit("@", 1)[-1]
        if not self._hosts:
            raise ValueError("kafka URL: give the bootstrap servers, e.g. kafka://127.0.0.1:9092?topic=jobs")
        self._client_conf = {k: v for k, v in query.items() if "." in k}
        self._id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # One consumer per topic, each in its own group (``group`` and ``group.retry``), so each
        # topic's partitions are balanced over the members on their own: one group over both
        # topics may hand a newcomer all the main partitions and none of the retry ones.
        self._consumers: dict[str, Consumer] = {}
        self._assigned: set[str] = set()  # topics whose consumer had its first assignment
        # Partitions read to their end since they were adopted: until every main one was, after
        # the first join, a receive has not seen the queue (a loaded broker's first fetches).
        # ``_warm`` once they all were: later rebalances wait no more.
        self._reached: set[tuple[str, int]] = set()
        self._warm = False
        self._stopping = False  # wake(): the consumer is stopping, the join's wait is over
        # Our releases on retry partitions this member owns, not read back yet: (partition,
        # offset) -> not-before. An empty receive is not idle while one is due (``_returning``).
        self._returns: dict[tuple[int, int], float] = {}
        self._dirty: set[tuple[str, int]] = set()  # partitions whose last commit did not go through
        self._producer: Producer | None = None
        self._admin: AdminClient | None = None
        self._parts: dict[tuple[str, int], _Part] = {}
        self._epochs = itertools.count(1)
        self._buffer: list[_Record] = []
        self._due_pauses: dict[tuple[str, int], float] = {}
        self._share_paused: set[tuple[str, int]] = set()  # paused at their share of the buffer (_pull)
        self._busy: dict[bytes, tuple[str, int]] = {}  # order=key: key -> partition of its message out
        self._down: str | None = None
        self._rr = itertools.count()

    # -- connection ------------------------------------------------------------------------------

    def _conf(self, role: str, **extra: Any) -> dict[str, Any]:
        """The settings of a ``consumer``, ``producer`` or ``admin`` client: the URL's own
        librdkafka settings that apply to it, then ``extra``."""
        skip = (_PRODUCER_ONLY if role != "producer" else frozenset()) | (
            _CONSUMER_ONLY if role != "consumer" else frozenset()
        )
        given = {k: v for k, v in self._client_conf.items() if k not in skip}
        return {
            "bootstrap.servers": self._hosts,
            "client.id": f"pandastack-{self._id}",
            "error_cb": self._on_error,
            "logger": _LIBRDKAFKA_LOG,
            **given,
            **extra,
        }

    def _on_error(self, err: KafkaError) -> None:
        if err.code() in _DOWN:
            self._down = err.str()
        logger.debug("kafka: %s", err.str())

    def connect(self) -> None:
        """Create the clients and the topics on the first call; afterwards, check the broker is
        reachable again (librdkafka reconnects by itself; the group membership is kept)."""
        if self._producer is None:
            conf = self._conf("producer", **{"enable.idempotence": True, "linger.ms": 5})
            # librdkafka's own 1,000,000 would refuse the retry of a message the consumer took (up
            # to max_body_bytes, 1 MiB by default): the topics' limits decide, unless the URL does.
            conf.setdefault("message.max.bytes", max(1_000_000, self._record_limit()))
            self._producer = Producer(conf)
            self._ensure_topics()
            if not self._stamps.signed:
                logger.warning(
                    "Kafka: neither PANDASTACK_QUEUE_SECRET nor PANDASTACK_API_KEY is set: %s's "
                    "stamps are not secret, only its ACLs keep producers out",
                    self.retry_topic,
                )
            return
        try:
            self._producer.list_topics(self.topic, timeout=5)
        except KafkaException as exc:
            raise BrokerUnavailable(f"Kafka at {self._hosts}: {exc.args[0].str()}") from None
        self._down = None

    def _ensure_topics(self) -> None:
        admin = AdminClient(self._conf("admin"))
        try:
            existing = set(admin.list_topics(timeout=10).topics)
        except KafkaException as exc:
            self._producer = None
            raise BrokerUnavailable(f"Kafka at {self._hosts}: {exc.args[0].str()}") from None
        wanted = [self.topic, self.retry_topic, self.dead_topic, self.reply_topic]
        # The retry and dead topics take any message the consumer took, plus what it adds: a
        # give-back in an outage or a retry never turns into a dead letter for its size alone.
        roomy = {"max.message.bytes": str(self._record_limit())}
        new = [
            NewTopic(
                t,
                num_partitions=self.partitions,
                config=roomy if t in (self.retry_topic, self.dead_topic) else {},
            )
            for t in wanted
            if t not in existing
        ]
        for topic, future in (admin.create_topics(new, operation_timeout=10) if new else {}).items():
            try:
                future.result(15)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    self._producer = None
                    raise BrokerUnavailable(f"Kafka: creating topic {topic}: {exc.args[0].str()}") from None
        meta = admin.list_topics(self.topic, timeout=10).topics.get(self.topic)
        self._main_partitions = len(meta.partitions) if meta and meta.partitions else self.partitions

    def _record_limit(self) -> int:
        """The largest record the transport writes for a message it took (a retry or a dead letter)."""
        return (self.max_body_bytes or DEFAULT_MAX_MESSAGE_BYTES) + _RECORD_HEADROOM

    def _subscribe(self) -> None:
        """Join the groups on the first receive (a transport that only sends never joins)."""
        if self._consumers:
            return
        for topic, group in ((self.topic, self.group), (self.retry_topic, f"{self.group}.retry")):
            conf = self._conf(
                "consumer",
                **{
                    "group.id": group,
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "auto.offset.reset": "earliest",
                    "partition.assignment.strategy": "cooperative-sticky",
                    "heartbeat.interval.ms": 1000,
                    "enable.partition.eof": True,  # a partition's end is seen (``_reached``)
                },
            )
            consumer = Consumer(conf)
            consumer.subscribe(
                [topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
            )
            self._consumers[topic] = consumer

    def _consume(self, n: int, timeout: float) -> list[Message]:
        """Up to ``n`` records from both consumers, waiting at most ``timeout`` on the main one.
        Events (a partition's end) come along and take no record's place: a chunk of ``n`` is
        not cut short by the ends of the partitions that had nothing (asked again without
        waiting, a bounded number of times: a stream of error events never spins here)."""
        got = self._consumers[self.retry_topic].consume(n, 0)
        records = sum(m.error() is None for m in got)
        wait = 0 if records else timeout
        for _ in range(_EVENT_ROUNDS):
            batch = self._consumers[self.topic].consume(max(1, n - records), wait)
            got += batch
            events = sum(m.error() is not None for m in batch)
            records += len(batch) - events
            if not events or records >= n:
                break
            wait = 0
        return got

    def wake(self) -> None:
        """The consumer is stopping: a receive waiting for the group's join ends at its own wait."""
        self._stopping = True

    def close(self) -> None:
        self._stopping = False  # opened again, the transport joins again
        if self._consumers:
            for consumer in self._consumers.values():
                try:
                    consumer.close()  # leaves the group: its partitions move at once
                except (KafkaException, RuntimeError):
                    pass
            self._consumers = {}
            self._forget(list(self._parts))
        if self._producer is not None:
            self._producer.flush(_FLUSH_SECONDS)
            self._producer = None
        self._admin = None

    # -- rebalances ------------------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if partitions:  # a first round may give a newcomer nothing yet (cooperative rebalancing)
            self._assigned.update(t for t, c in self._consumers.items() if c is consumer)
        self._adopt(consumer, partitions)
        logger.info("kafka: assigned %s", _names(partitions))

    def _adopt(self, consumer: Consumer, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """Start keeping ``partitions`` from their committed offsets (and the starts recorded
        with them); returns the committed positions."""
        committed = consumer.committed(partitions, timeout=10) if partitions else []
        for tp in committed:
            starts: dict[int, int] = {}
            settled: list[tuple[int, int]] = []
            try:
                doc = json.loads(tp.metadata or "{}")
                starts = {int(o): int(n) for o, n in doc.get("starts", {}).items()}
                settled = [(int(a), int(b)) for a, b in doc.get("settled", [])]
            except (ValueError, TypeError, AttributeError):
                starts, settled = {}, []  # not ours to read: counts start again
            point = tp.offset if tp.offset >= 0 else -1
            self._parts[(tp.topic, tp.partition)] = _Part(
                epoch=next(self._epochs),
                committed=point,
                high=max(point, 0),
                starts=starts,
                settled=settled,
            )
        return list(committed)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._forget([(tp.topic, tp.partition) for tp in partitions])
        logger.info("kafka: revoked %s; their running jobs are no longer ours", _names(partitions))

    def _forget(self, tps: list[tuple[str, int]]) -> None:
        gone = set(tps)
        self._dirty -= gone
        self._reached -= gone
        for tp in gone:
            self._parts.pop(tp, None)
            self._due_pauses.pop(tp, None)
        self._buffer = [r for r in self._buffer if (r.ref.topic, r.ref.partition) not in gone]
        self._share_paused -= gone
        self._busy = {k: tp for k, tp in self._busy.items() if tp not in gone}
        self._returns = {
            at: due for at, due in self._returns.items() if (self.retry_topic, at[0]) not in gone
        }

    def owned(self) -> list[int]:
        """The main topic's partitions this member holds now. A consumer is ``ready`` once
        connected, before the group has given it any: only then does it compete for messages."""
        return sorted(p for t, p in list(self._parts) if t == self.topic)

    def lost(self, delivery: Delivery) -> bool:
        ref: _Ref = delivery.handle
        part = self._parts.get((ref.topic, ref.partition))
        return part is None or part.epoch != ref.epoch

    # -- receiving -------------------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Poll between receives, so rebalances and errors are served while every slot is busy;
        records go to a bounded buffer, and past it the partitions pause."""
        if not self._consumers:
            return
        if self._down:
            down, self._down = self._down, None
            raise BrokerUnavailable(f"Kafka at {self._hosts}: {down}")
        self._resume_due()
        if self._dirty:
            self._commit(set(self._dirty))
        self._pull(_PREFETCH, 0)

    def _pull(self, n: int, timeout: float) -> None:
        """Poll both consumers, waiting at most ``timeout``, and buffer up to ``n`` records, never
        more than the buffer's room. Each assigned partition holds at most its share of the
        buffer (_PREFETCH over the partitions, at least one record), then pauses: a key's flood
        (order=key), on any number of partitions, never takes the room another partition's
        messages need to come in and run. So the records held, and their bodies' memory, stay
        bounded by max(_PREFETCH, partitions) however long a receive waits; with every partition
        at its share the poll only serves the clients' callbacks (rebalances, errors)."""
        share = max(1, _PREFETCH // max(1, len(self._parts)))
        held = Counter((r.ref.topic, r.ref.partition) for r in self._buffer)
        self._pause_only({tp for tp, k in held.items() if k >= share})
        self._take(self._consume(max(1, min(n, _PREFETCH - len(self._buffer))), timeout))

    def _pause_only(self, tps: set[tuple[str, int]]) -> None:
        """Keep exactly ``tps`` paused for the buffer (those paused for a retry's due stay so):
        only what changed is paused or resumed, a pause drops what the client had fetched."""
        tps -= set(self._due_pauses)
        now = self._share_paused
        for topic, consumer in self._consumers.items():
            resume = [
                TopicPartition(t, p) for t, p in now - tps if t == topic and (t, p) not in self._due_pauses
            ]
            pause = [TopicPartition(t, p) for t, p in tps - now if t == topic]
            if resume:
                consumer.resume(resume)
            if pause:
                consumer.pause(pause)
        self._share_paused = tps

    def receive(self, max_messages: int, wait_seconds: float) -> list[Delivery]:
        self._subscribe()
        self._resume_due()
        start = time.monotonic()
        deadline = start + wait_seconds
        if not self._fetched():
            # Until the group has assigned partitions (a join takes a rebalance) and each has been
            # read to its end once, an empty receive is not an idle queue (an engine's batch must
            # not end on it), and what it hands out is not all there is (the first chunks would
            # be cut by the order the partitions' first fetches answer in). It waits up to
            # _JOIN_SECONDS for that, or for ``max_messages``; not once records wait in the
            # buffer, and the bound holds once per transport (below).
            deadline = max(deadline, start + _JOIN_SECONDS)
        out: list[Delivery] = []
        while True:
            out += self._hand_out(max_messages - len(out))
            now = time.monotonic()
            returning = self._returning(wait_seconds)
            if returning and not out:  # a release of ours due now: an empty receive is not idle yet
                deadline = max(deadline, now + returning)
            if self._stopping:  # a SIGTERM is not held by the join's wait
                deadline = min(deadline, start + wait_seconds)
            # Once something fetched waits in the buffer (a busy key's flood fills it, pauses its
            # partition and so never lets it reach its end), the view is not cold any more: the
            # receive waits its own time, not the join's.
            settled = self._fetched() or bool(self._buffer)
            if (
                len(out) >= max_messages
                or now >= deadline
                or (out and settled)
                or (settled and not returning and now >= start + wait_seconds)
            ):
                break
            until = deadline if not settled or returning else start + wait_seconds
            self._pull(max_messages, max(0.0, min(until - now, 0.5)))
            self._resume_due()
        if not self._warm and time.monotonic() - start >= _JOIN_SECONDS:
            # The join's bound ran out without every partition fetched (a member the group gave
            # none, a partition whose leader is away): it applies once per transport, later
            # receives (and the consumer's loop, which hears SIGTERM between them) wait their own.
            self._warm = True
        if out:
            self._commit({(r.topic, r.partition) for r in (d.handle for d in out)})  # the starts
        return out

    def _returning(self, wait_seconds: float) -> float:
        """How long to wait for our releases that are due within ``wait_seconds`` and not read back
        yet (0: none): at most _RETURN_SECONDS past each one's due. An engine's batch ends after
        an idle spell, and a loaded broker's fetch of a just-released message can take longer."""
        now = time.time()
        for at in [
            at
            for at, due in self._returns.items()
            if now >= due + _RETURN_SECONDS or not self._may_read_back(at[0])
        ]:
            del self._returns[at]  # given up on, or another member's: never waited for again
        if wait_seconds <= 0 or any(part.open for part in self._parts.values()):
            return 0.0  # a poll, or messages in flight: the loop has other work, a batch is not idle
        soon = [due for due in self._returns.values() if due <= now + wait_seconds]
        return max(soon) + _RETURN_SECONDS - now if soon else 0.0

    def _may_read_back(self, partition: int) -> bool:
        """Whether a record on this retry partition may come back to this member: it owns the
        partition, or the retry topic's consumer has no assignment yet (it joins its group
        seconds after the main one on a loaded broker, and a lone member gets every partition)."""
        return self.retry_topic not in self._assigned or (self.retry_topic, partition) in self._parts

    def _fetched(self) -> bool:
        """Whether the main topic was assigned and each of its partitions here read to its end
        once, since the first receive. Kept once true (and set when a receive's join bound ran
        out): a partition gained in a later rebalance, or one whose leader is away, never holds a
        receive (and the consumer's loop) past its wait."""
        if not self._warm:
            mine = [tp for tp in self._parts if tp[0] == self.topic]
            self._warm = self.topic in self._assigned and all(tp in self._reached for tp in mine)
        return self._warm

    def _take(self, msgs: list[Message]) -> None:
        """Buffer what Kafka handed us; a retry record not yet due pauses its partition there."""
        held: set[tuple[str, int]] = set()
        now = time.time()
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() in _DOWN:
                    self._down = err.str()
                elif err.code() == KafkaError._PARTITION_EOF:
                    self._reached.add((m.topic() or "", m.partition() or 0))
                else:
                    logger.warning("kafka: %s", err.str())
                continue
            topic, partition, offset = m.topic() or "", m.partition() or 0, m.offset() or 0
            tp = (topic, partition)
            part = self._parts.get(tp)
            if tp in held:
                continue
            if part is None:
                self._readopt(topic, partition)
                held.add(tp)
                continue
            ref = self._ref(m, part, topic, partition, offset)
            if topic == self.retry_topic and ref.malformed is None:  # a forged not-before holds nothing
                due = _float(_headers(m).get("not_before"))
                if due > now:
                    self._consumers[topic].seek(TopicPartition(topic, partition, offset))
                    self._consumers[topic].pause([TopicPartition(topic, partition)])
                    self._due_pauses[tp] = due
                    held.add(tp)
                    continue
            if topic == self.retry_topic and self._returns:  # back: no receive waits for it any more
                for at in [at for at in self._returns if at[0] == partition and at[1] <= offset]:
                    del self._returns[at]
            part.high = max(part.high, offset + 1)
            if part.was_settled(offset):
                continue  # settled by the previous owner, past its commit point: not again
            part.open.add(offset)
            self._buffer.append(_Record(ref, m.value() or b""))

    def _readopt(self, topic: str, partition: int) -> None:
        """A record of a partition we forgot (a fenced commit) that the client still has
        assigned: keep it again from its committed offset, where the next owner would start."""
        consumer = self._consumers[topic]
        tp = TopicPartition(topic, partition)
        if not any((a.topic, a.partition) == (topic, partition) for a in consumer.assignment()):
            return
        (at,) = self._adopt(consumer, [tp])
        consumer.seek(TopicPartition(topic, partition, at.offset if at.offset >= 0 else OFFSET_BEGINNING))
        logger.info("kafka: %s[%d] taken up again from its committed offset", topic, partition)

    def _ref(self, m: Message, part: _Part, topic: str, partition: int, offset: int) -> _Ref:
        """Where the record is, and whose: a retry record is the message its stamp names, if a
        consumer signed it; otherwise a record of its own, to be dead-lettered naming ``sig``."""
        mid, prior, malformed = f"{partition}-{offset}", 0, None
        h = _headers(m)
        kind, ms = m.timestamp()
        sent = f"{ms / 1000:.3f}" if kind and ms > 0 else None
        if topic == self.retry_topic:
            given, count, due = h.get("mid", ""), _count(h.get("count")), h.get("not_before", "")
            if count > 0 and self._stamps.verify(h.get("sig"), given, count, m.value() or b"", due):
                mid, prior = given, count
                sent = h.get("sent") or sent  # the original record's time, carried by the release
            else:
                mid = f"retry:{partition}-{offset}"
                problem = f"is not a consumer's signature: {self.retry_topic} is written by consumers only"
                malformed = ("headers.sig", problem)
        key = m.key()
        key_bytes = key.encode() if isinstance(key, str) else key
        return _Ref(
            topic,
            partition,
            offset,
            part.epoch,
            key_bytes,
            prior,
            mid,
            sent=sent,
            traceparent=valid_traceparent(h.get("traceparent")),
            malformed=malformed,
        )

    def _hand_out(self, n: int) -> list[Delivery]:
        out: list[Delivery] = []
        now = time.time()
        blocked: set[bytes] = set(self._busy)
        for rec in list(self._buffer):
            if len(out) >= n:
                break
            key = rec.ref.key
            if self.ordered and key is not None:
                if key in blocked:
                    continue
                blocked.add(key)  # a later message of this key waits, even if this one is held
                if rec.due > now:
                    continue
                self._busy[key] = (rec.ref.topic, rec.ref.partition)
            elif rec.due > now:
                continue
            self._buffer.remove(rec)
            part = self._parts[(rec.ref.topic, rec.ref.partition)]
            part.starts[rec.ref.offset] = part.starts.get(rec.ref.offset, 0) + 1
            count = rec.ref.prior + part.starts[rec.ref.offset]
            ref = rec.ref
            extra = {"sent": ref.sent, "traceparent": ref.traceparent}
            out.append(
                Delivery(ref.message_id, rec.value, count, handle=ref, extra=extra, malformed=ref.malformed)
            )
        return out

    def _resume_due(self) -> None:
        if not self._due_pauses or not self._consumers:
            return
        now = time.time()
        due = [tp for tp, at in self._due_pauses.items() if at <= now]
        for tp in due:
            del self._due_pauses[tp]
        if due:
            for t, p in due:
                self._consumers[t].resume([TopicPartition(t, p)])

    # -- settling --------------------------------------------------------------------------------

    def _part_of(self, delivery: Delivery) -> _Part:
        ref: _Ref = delivery.handle
        part = self._parts.get((ref.topic, ref.partition))
        if part is None or part.epoch != ref.epoch:
            raise LeaseLost(f"partition {ref.topic}[{ref.partition}] was revoked (a rebalance)")
        return part

    def _settle(self, delivery: Delivery) -> None:
        ref: _Ref = delivery.handle
        part = self._part_of(delivery)
        part.open.discard(ref.offset)
        if ref.key is not None:
            self._busy.pop(ref.key, None)
        self._commit({(ref.topic, ref.partition)})

    def _commit(self, tps: set[tuple[str, int]]) -> None:
        """Commit each partition's point (never past an open offset) with its starts."""
        if not self._consumers:
            return
        offsets = []
        for t, p in tps:
            part = self._parts.get((t, p))
            if part is None:
                continue
            point = part.commit_point()
            for o in [o for o in part.starts if o < point]:
                del part.starts[o]
            offsets.append(TopicPartition(t, p, max(point, 0), metadata=part.metadata()))
        for topic in {tp.topic for tp in offsets}:
            mine = [tp for tp in offsets if tp.topic == topic]
            self._dirty.update((tp.topic, tp.partition) for tp in mine)
            try:
                failed = [
                    tp.error for tp in self._consumers[topic].commit(offsets=mine, asynchronous=False) or []
                ]
            except KafkaException as exc:
                failed = [exc.args[0]]
            errors = [e for e in failed if e is not None]
            if errors and errors[0].code() not in _FENCED:
                raise BrokerUnavailable(f"Kafka at {self._hosts}: commit failed: {errors[0].str()}")
            if errors:
                # A rebalance is under way (or the group forgot us): the settle stands here and
                # the commit is retried on the next turn; if the partition is revoked meanwhile,
                # its new owner starts from the last commit that went through.
                logger.info("kafka: commit deferred: %s", errors[0].str())
                continue
            for tp in mine:
                self._dirty.discard((tp.topic, tp.partition))
                part = self._parts.get((tp.topic, tp.partition))
                if part is not None:
                    part.committed = tp.offset

    def _publish(
        self, topic: str, value: bytes, key: bytes | None, headers: dict[str, str]
    ) -> tuple[int, int]:
        """Produce one record and wait until the broker has it (before the original is settled);
        returns its partition and offset."""
        if self._producer is None:
            raise BrokerUnavailable("Kafka: not connected")
        failed: list[KafkaError] = []
        written: list[tuple[int, int]] = []

        def done(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                failed.append(err)
            else:
                written.append((msg.partition() or 0, msg.offset() or 0))

        try:
            self._producer.produce(
                topic, value=value, key=key, headers=list(headers.items()), on_delivery=done
            )
        except KafkaException as exc:
            if exc.args[0].code() in _REJECTED:
                raise _rejected(topic, value, key, headers, exc.args[0]) from None
            raise BrokerUnavailable(f"Kafka at {self._hosts}: {exc}") from None
        except BufferError as exc:
            raise BrokerUnavailable(f"Kafka at {self._hosts}: {exc}") from None
        if self._producer.flush(_FLUSH_SECONDS) > 0:
            raise BrokerUnavailable(f"Kafka at {self._hosts}: {topic} did not take the record in time")
        if failed and failed[0].code() in _REJECTED:
            raise _rejected(topic, value, key, headers, failed[0])
        if failed:
            raise BrokerUnavailable(f"Kafka at {self._hosts}: {topic}: {failed[0].str()}")
        return written[0] if written else (-1, -1)

    def ack(self, delivery: Delivery) -> None:
        self._settle(delivery)

    def release(self, delivery: Delivery, delay_seconds: float) -> None:
        ref: _Ref = delivery.handle
        self._part_of(delivery)
        if self.ordered and ref.key is not None:
            # Held here, uncommitted, and handed out again when due: the key's later messages wait.
            self._buffer.insert(0, _Record(ref, delivery.body, due=time.time() + max(0.0, delay_seconds)))
            self._busy.pop(ref.key, None)
            return
        due = f"{time.time() + max(0.0, delay_seconds):.3f}"
        headers = {
            "mid": delivery.message_id,
            "count": str(delivery.count),
            "not_before": due,
            "sig": self._stamps.sign(delivery.message_id, delivery.count, delivery.body, due),
            **({"sent": ref.sent} if ref.sent else {}),
            **({"traceparent": ref.traceparent} if ref.traceparent else {}),
        }
        at = self._publish(self.retry_topic, delivery.body, ref.key, headers)
        if self._may_read_back(at[0]):  # receives wait for it when due
            self._returns[at] = float(due)
        self._settle(delivery)

    def dead_letter(self, delivery: Delivery, why: DeadLetter) -> None:
        ref: _Ref = delivery.handle
        self._part_of(delivery)
        try:
            self._publish(
                self.dead_topic, delivery.body, ref.key, {"mid": delivery.message_id, "why": why.to_json()}
            )
        except RecordRejected as exc:
            # Too large to dead-letter whole (a ~1 MB body or key plus the reason): dead-lettered
            # all the same, without them, the reason saying where the original still is.
            # First, so a bound on the reason's length never cuts it off.
            kept = (
                f"[not kept: the body of {len(delivery.body)} bytes and the key of"
                f" {len(ref.key or b'')} bytes, the dead letter being refused whole ({exc}); the"
                f" original is {ref.topic}[{ref.partition}] at offset {ref.offset}, while the"
                f" topic's retention keeps it] {why.reason}"
            )
            short = dataclasses.replace(why, reason=kept)
            self._publish(self.dead_topic, b"", None, {"mid": delivery.message_id, "why": short.to_json()})
        self._settle(delivery)

    def _dead_records(self) -> list[tuple[Message, DeadLetterRecord]]:
        """Every dead letter of ``<topic>.dead`` not marked requeued, oldest first per partition.
        Read by a consumer of its own (assigned, no group commit): the topic is kept, and a
        requeue appends a marker record (header ``requeued``: the broker id) instead of deleting."""
        reader = Consumer(self._conf("consumer", **{"group.id": f"pandastack-reader-{uuid.uuid4().hex}"}))
        out: list[Message] = []
        try:
            meta = reader.list_topics(self.dead_topic, timeout=10).topics.get(self.dead_topic)
            for p in sorted(meta.partitions if meta is not None else []):
                low, high = reader.get_watermark_offsets(TopicPartition(self.dead_topic, p), timeout=10)
                if high <= low:
                    continue
                reader.assign([TopicPartition(self.dead_topic, p, low)])
                got: list[Message] = []
                deadline = time.monotonic() + 30
                while len(got) < high - low and time.monotonic() < deadline:
                    got += [m for m in reader.consume(high - low - len(got), 0.5) if m.error() is None]
                if len(got) < high - low:
                    raise BrokerUnavailable(f"Kafka at {self._hosts}: {self.dead_topic}[{p}] not read in 30s")
                out += got
        except KafkaException as exc:
            raise BrokerUnavailable(f"Kafka at {self._hosts}: {exc.args[0].str()}") from None
        finally:
            reader.close()
        marked = {_headers(m).get("requeued") for m in out}
        recs = []
        for m in out:
            h = _headers(m)
            if "requeued" in h or h.get("mid") in marked:
                continue
            mid = h.get("mid") or f"{m.partition()}-{m.offset()}"
            kind, ms = m.timestamp()
            at = ms / 1000 if kind and ms > 0 else None
            recs.append((m, DeadLetterRecord.stored(mid, m.value() or b"", h.get("why"), at)))
        return recs

    def dead_letters(self, limit: int = 100) -> list[DeadLetterRecord]:
        """From ``<topic>.dead``, read from the start, leaving out those marked requeued."""
        return [rec for _, rec in self._dead_records()[:limit]]

    def _put_back(self, broker_id: str) -> str | None:
        """Produce the body (with its key) to ``<topic>``: a new record, a new id, delivery 1; then
        a marker record on ``<topic>.dead`` (header ``requeued``), so the dead letter stays with
        its reason but is not listed again. Killed between the two, a second requeue would
        produce it twice (at least once)."""
        found = next(((m, rec) for m, rec in self._dead_records() if rec.broker_id == broker_id), None)
        if found is None:
            return None
        m, rec = found
        self.send(rec.body, key=m.key())
        self._publish(self.dead_topic, b"", m.key(), {"requeued": broker_id})
        return ""

    def extend(self, delivery: Delivery) -> None:
        """Nothing to do: a partition stays ours until a rebalance (then :meth:`lost` says so)."""

    def reply(self, body: bytes) -> None:
        self._publish(self.reply_topic, body, None, {})

    def send(
        self,
        body: bytes,
        message_id: str | None = None,
        key: bytes | str | None = None,
        traceparent: str | None = None,
    ) -> None:
        """Produce ``body`` to the topic. ``key`` (by default the message's ``tenant``) picks the
        partition, so one key's messages keep their order; without one, partitions are taken in
        turn. ``traceparent`` goes in a record header of that name (read back as untrusted).
        ``message_id`` is not sent: a Kafka message's id is its partition and offset."""
        if self._producer is None:
            raise BrokerUnavailable("Kafka: not connected")
        if key is None:
            key = _tenant(body)
        if isinstance(key, str):
            key = key.encode()
        headers: list[tuple[str, str | bytes | None]] | None = (
            [("traceparent", traceparent)] if traceparent else None
        )
        try:
            if key is None:
                partition = next(self._rr) % self._main_partitions
                self._producer.produce(self.topic, value=body, partition=partition, headers=headers)
            else:
                self._producer.produce(self.topic, value=body, key=key, headers=headers)
        except (KafkaException, BufferError) as exc:
            raise BrokerUnavailable(f"Kafka at {self._hosts}: {exc}") from None
        if self._producer.flush(_FLUSH_SECONDS) > 0:
            raise BrokerUnavailable(f"Kafka at {self._hosts}: the topic did not take the message in time")

    def send_traced(self, body: bytes, traceparent: str | None) -> None:
        """A record with a ``traceparent`` header (the W3C trace context of the producer's span)."""
        self.send(body, traceparent=traceparent)

    def backlog(self) -> dict[str, int] | None:
        """The groups' lag: per partition, the end offset minus the group's committed one (the
        start offset where it committed none), summed; ``ready`` on the topic, ``delayed`` on
        the retry topic. Kafka commits offsets, not messages: ``ready`` also counts the group's
        messages in flight and those settled above an unsettled one (the commit never passes
        it), so it is an upper bound of what waits."""
        if self._producer is None:
            raise BrokerUnavailable("Kafka: not connected")
        if self._admin is None:  # kept: the consumer's metrics read the backlog every few seconds
            self._admin = AdminClient(self._conf("admin"))
        admin = self._admin
        for attempt in range(BACKLOG_ATTEMPTS):
            try:
                return {
                    "ready": self._lag(admin, self.topic, self.group),
                    "delayed": self._lag(admin, self.retry_topic, f"{self.group}.retry"),
                }
            except KafkaException as exc:
                error = exc.args[0]
                # A retriable answer (the group coordinator still loading its offsets, just after
                # a start or a move) is asked again; anything else, or the last, is the broker's.
                # librdkafka wraps the coordinator's answer in a failure that is not flagged
                # retriable ("... response failure: Broker: Coordinator load in progress").
                again = error.retriable() or any(c in error.str() for c in _COORDINATOR_BUSY)
                if not again or attempt == BACKLOG_ATTEMPTS - 1:
                    raise BrokerUnavailable(f"Kafka at {self._hosts}: {error.str()}") from None
                time.sleep(0.5)
        return None  # not reached: the last attempt returns or raises

    @staticmethod
    def _lag(admin: AdminClient, topic: str, group: str) -> int:
        meta = admin.list_topics(topic, timeout=10).topics.get(topic)
        tps = [TopicPartition(topic, p) for p in sorted(meta.partitions if meta is not None else [])]
        if not tps:
            return 0
        request = [ConsumerGroupTopicPartitions(group, tps)]
        found = admin.list_consumer_group_offsets(request, request_timeout=10)[group].result(15)
        committed = {tp.partition: tp.offset for tp in found.topic_partitions or []}
        ends = admin.list_offsets({tp: OffsetSpec.latest() for tp in tps}, request_timeout=10)
        starts = admin.list_offsets({tp: OffsetSpec.earliest() for tp in tps}, request_timeout=10)
        lag = 0
        for tp in tps:
            end = ends[tp].result(15).offset
            start = starts[tp].result(15).offset
            at = committed.get(tp.partition, -1)
            lag += max(0, end - max(at, start))
        return lag


def dead_reason(headers: list[tuple[str, bytes]] | None) -> dict[str, Any]:
    """The :class:`DeadLetter` a record of ``<topic>.dead`` carries."""
    raw = dict(headers or {}).get("why")
    return json.loads(raw) if raw else {}


def _rejected(
    topic: str, value: bytes, key: bytes | None, headers: dict[str, str], err: KafkaError
) -> RecordRejected:
    """The refusal of one record, naming its topic, its size and the settings that bound it."""
    size = len(value) + len(key or b"") + sum(len(k) + len(v.encode()) for k, v in headers.items())
    return RecordRejected(
        f"Kafka: {topic} refused a record of {size} bytes ({err.str()}); raise the topic's"
        " max.message.bytes and the producer's message.max.bytes (a kafka:// URL setting,"
        " e.g. &message.max.bytes=2000000) above it, or make it smaller",
        size=size,
    )


def _tenant(body: bytes) -> str | None:
    """The message's ``tenant``, when it is a JSON object with a non-empty string one (else no key)."""
    return body_string(body, "tenant") or None


def _headers(m: Message) -> dict[str, str]:
    out: dict[str, str] = {}
    pairs: list[tuple[str, Any]] = list(m.headers() or [])  # type: ignore[arg-type]
    for k, v in pairs:
        try:
            out[k] = v.decode() if isinstance(v, bytes) else str(v or "")
        except UnicodeDecodeError:
            continue
    return out


def _count(text: str | None) -> int:
    """A retry record's ``count`` header: a consumer writes a plain positive decimal; anything
    else is -1 (and its stamp cannot verify)."""
    if not text or not text.isascii() or not text.isdecimal() or len(text) > len(str(MAX_PRIOR)):
        return -1
    return int(text)


def _float(text: str | None) -> float:
    try:
        return float(text or "0")
    except ValueError:
        return 0.0


def _names(partitions: list[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "nothing"

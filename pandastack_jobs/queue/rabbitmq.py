"""RabbitMQ through pika: manual acks on quorum queues, delay queues, a dead-letter exchange.

AMQP has no broker-assigned message id, and everything on a message (properties,
headers) is the producer's. So the consumer gives each message its identity once:
it takes the message from the producers' queue ``<queue>``, publishes it to its
own quorum queue ``<queue>.work`` with a consumer-assigned id and the count of
earlier deliveries, signed (HMAC-SHA256 over the queue, the id, the count and the
body's hash, with a key only consumers hold), and acks the original; every publish
waits for the broker's confirm. A message on ``<queue>`` that carries an
``x-pandastack-*`` header is dead-lettered naming it; one on ``<queue>.work``
whose signature does not verify (a producer that could write there) likewise.
The delivery count is the signed count plus the broker's ``x-delivery-count``.

An unacked message stays with this consumer until it is acked or the channel
closes (then RabbitMQ requeues it, stamp and all: a killed worker's messages come
back by themselves, under the same id), so there is no lease to extend; mind the
broker's ``consumer_timeout`` (30 min by default) for longer jobs. A release
publishes the message, signed with its count, to ``<queue>.work.delay.<ms>``, a
queue whose TTL dead-letters it back into ``<queue>.work``, then acks the
original. Dead letters go to the exchange ``<queue>.dlx`` (also the queues' own
dead-letter exchange) bound to ``<queue>.dead``.

The signing key: ``secret=``, else ``$PANDASTACK_QUEUE_SECRET``, else the PandaStack API
key (``$PANDASTACK_API_KEY``: every consumer holds it, no producer may), each run through
HMAC with the queue's name (``stamps.py``, shared with Kafka's retry topic).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import pika
import pika.exceptions

from .stamps import Stamper
from .transport import BrokerUnavailable, DeadLetter, DeadLetterRecord, Delivery, Transport

logger = logging.getLogger(__name__)

_ERRORS = (pika.exceptions.AMQPError, OSError)
_MID, _PRIOR, _SIG = "x-pandastack-mid", "x-pandastack-prior", "x-pandastack-sig"
_RESERVED_PREFIX = "x-pandastack-"
_DELAYS_MS = (0, 1000, 2000, 5000, 10000, 30000, 60000, 300000, 900000, 3600000)


class RabbitMQTransport(Transport):
    """``amqp://user:pass@host:port/vhost?queue=jobs`` (``amqps://`` for TLS)."""

    lease_seconds = None

    def __init__(self, url: str, lease_seconds: float | None = None, secret: str | None = None) -> None:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.name = query.pop("queue", "pandastack-jobs")
        query.setdefault("heartbeat", "30")
        query.setdefault("connection_attempts", "1")
        query.setdefault("socket_timeout", "10")
        self._url = urlunsplit(parts._replace(query="&".join(f"{k}={v}" for k, v in query.items())))
        self.dlx, self.dead_queue, self.reply_queue = (
            f"{self.name}.dlx",
            f"{self.name}.dead",
            f"{self.name}.results",
        )
        self.work_queue = f"{self.name}.work"
        self._stamps = Stamper(self.name, secret)
        self.signed = self._stamps.signed
        self._conn: pika.BlockingConnection | None = None
        self._ch: Any = None
        self._generation = 0
        self._delay_queues: set[int] = set()

    def connect(self) -> None:
        self.close()
        try:
            conn = pika.BlockingConnection(pika.URLParameters(self._url))
            ch = conn.channel()
            ch.confirm_delivery()
            ch.exchange_declare(self.dlx, "fanout", durable=True)
            ch.queue_declare(self.dead_queue, durable=True)
            ch.queue_bind(self.dead_queue, self.dlx)
            ch.queue_declare(self.reply_queue, durable=True)
            args = {"x-queue-type": "quorum", "x-dead-letter-exchange": self.dlx}
            ch.queue_declare(self.name, durable=True, arguments=args)
            ch.queue_declare(self.work_queue, durable=True, arguments=args)
        except _ERRORS as exc:
            raise BrokerUnavailable(f"RabbitMQ at {_safe(self._url)}: {_why(exc)}") from None
        if not self.signed:
            logger.warning(
                "RabbitMQ: neither PANDASTACK_QUEUE_SECRET nor PANDASTACK_API_KEY is set: %s's stamps "
                "are not secret, only its permissions keep producers out",
                self.work_queue,
            )
        self._conn, self._ch = conn, ch
        self._generation += 1
        self._delay_queues = set()

    def close(self) -> None:
        if self._conn is not None:
            try:
                if self._conn.is_open:
                    self._conn.close()
            except _ERRORS:
                pass
            self._conn = self._ch = None

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._ch is None:
            raise BrokerUnavailable("RabbitMQ: not connected")
        try:
            return fn(*args, **kwargs)
        except _ERRORS as exc:
            self.close()
            raise BrokerUnavailable(f"RabbitMQ at {_safe(self._url)}: {_why(exc)}") from None

    def lost(self, delivery: Delivery) -> bool:
        return delivery.generation != self._generation

    def heartbeat(self) -> None:
        if self._conn is not None:
            self._call(self._conn.process_data_events, 0)

    def receive(self, max_messages: int, wait_seconds: float) -> list[Delivery]:
        """Signed messages from ``<queue>.work`` first; when it is empty, move up to
        ``max_messages`` from ``<queue>`` into it (each given its id), then read them back."""
        out: list[Delivery] = []
        waited = 0.0
        moved = 0
        while len(out) < max_messages:
            method, props, body = self._call(self._ch.basic_get, self.work_queue, auto_ack=False)
            if method is not None:
                out.append(self._delivery(method.delivery_tag, props, body))
                continue
            if moved < max_messages:
                method, props, body = self._call(self._ch.basic_get, self.name, auto_ack=False)
                if method is not None:
                    moved += 1
                    bad = self._take(method.delivery_tag, props, body)
                    if bad is not None:
                        out.append(bad)
                    continue
            if out or waited >= wait_seconds:
                break
            self._call(self._conn.process_data_events, 0.1)  # type: ignore[union-attr]
            waited += 0.1
        return out

    def _stamp(self, mid: str, prior: int, body: bytes) -> dict[str, Any]:
        return {_MID: mid, _PRIOR: prior, _SIG: self._stamps.sign(mid, prior, body)}

    def _take(self, tag: int, original: pika.BasicProperties, body: bytes) -> Delivery | None:
        """A producer's message: give it its id (publish it, signed, to the work queue; then ack
        it here). One that carries consumer bookkeeping headers is returned to be dead-lettered."""
        mid = uuid.uuid4().hex
        headers = original.headers or {}
        names = sorted(str(k) for k in (headers or {}) if str(k).startswith(_RESERVED_PREFIX))
        if names:
            problem = "is consumer bookkeeping; a producer may not set it"
            return Delivery(
                mid,
                body,
                1,
                handle=tag,
                generation=self._generation,
                malformed=(f"headers.{names[0]}", problem),
            )
        # Producer-written, carried as they are (validated where used): the send time and the trace.
        tp = headers.get("traceparent")
        carried = {"traceparent": tp} if isinstance(tp, (str, bytes)) else {}
        sent = original.timestamp if isinstance(original.timestamp, int) else None
        props = pika.BasicProperties(
            delivery_mode=2, timestamp=sent, headers={**carried, **self._stamp(mid, 0, body)}
        )
        self._call(self._ch.basic_publish, "", self.work_queue, body, props, mandatory=False)
        self._call(self._ch.basic_ack, tag)
        return None

    def _delivery(self, tag: int, props: pika.BasicProperties, body: bytes) -> Delivery:
        """A work-queue message: its id and count, if a consumer signed them (never raises)."""
        h = props.headers or {}
        extra = {"sent": props.timestamp, "traceparent": h.get("traceparent")}
        mid, prior, sig = h.get(_MID), h.get(_PRIOR), h.get(_SIG)
        try:
            if not (
                isinstance(mid, str) and isinstance(prior, int) and self._stamps.verify(sig, mid, prior, body)
            ):
                raise ValueError("unsigned")
            count = h.get("x-delivery-count", 0)  # the broker's: set when it requeued the message
            broker_count = count if isinstance(count, int) and 0 <= count < 1_000_000 else 0
            count_ = prior + broker_count + 1
            return Delivery(mid, body, count_, handle=tag, generation=self._generation, extra=extra)
        except Exception:  # noqa: BLE001 - confined to this message
            problem = f"is not a consumer's signature: {self.work_queue} is written by consumers only"
            logger.warning("message on %s without a valid stamp; dead-lettering it", self.work_queue)
            return Delivery(
                uuid.uuid4().hex,
                body,
                1,
                handle=tag,
                generation=self._generation,
                malformed=(f"headers.{_SIG}", problem),
            )

    def _publish(self, exchange: str, routing_key: str, delivery: Delivery, headers: dict[str, Any]) -> None:
        carried = {"traceparent": delivery.extra["traceparent"]} if delivery.extra.get("traceparent") else {}
        sent = delivery.extra.get("sent")
        props = pika.BasicProperties(
            delivery_mode=2,
            message_id=delivery.message_id,
            timestamp=sent if isinstance(sent, int) else None,
            headers={**carried, **headers},
        )
        self._call(self._ch.basic_publish, exchange, routing_key, delivery.body, props, mandatory=False)

    def ack(self, delivery: Delivery) -> None:
        self._call(self._ch.basic_ack, delivery.handle)

    def release(self, delivery: Delivery, delay_seconds: float) -> None:
        ms = next((d for d in _DELAYS_MS if d >= delay_seconds * 1000), _DELAYS_MS[-1])
        target = self.work_queue
        if ms:
            target = f"{self.work_queue}.delay.{ms}"
            if ms not in self._delay_queues:
                args = {
                    "x-message-ttl": ms,
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": self.work_queue,
                }
                self._call(self._ch.queue_declare, target, durable=True, arguments=args)
                self._delay_queues.add(ms)
        self._publish("", target, delivery, self._stamp(delivery.message_id, delivery.count, delivery.body))
        self.ack(delivery)

    def dead_letter(self, delivery: Delivery, why: DeadLetter) -> None:
        self._publish(self.dlx, "", delivery, {_MID: delivery.message_id, "x-pandastack-dead": why.to_json()})
        self.ack(delivery)

    def _peek_dead(self, limit: int) -> list[tuple[int, bytes, DeadLetterRecord]]:
        r"""Up to ``limit`` messages of ``<queue>.dead``, taken unacked (AMQP has no browse): the
        caller acks or ``_unhide``\ s them (back in the queue, in their order)."""
        got: list[tuple[int, bytes, DeadLetterRecord]] = []
        while len(got) < limit:
            method, props, body = self._call(self._ch.basic_get, self.dead_queue, auto_ack=False)
            if method is None:
                break
            headers = props.headers or {}
            mid = headers.get(_MID) or props.message_id or f"tag-{method.delivery_tag}"
            mid = mid.decode() if isinstance(mid, bytes) else str(mid)
            rec = DeadLetterRecord.stored(mid, body, headers.get("x-pandastack-dead"), None)
            got.append((method.delivery_tag, body, rec))
        return got

    def _unhide(self, tags: list[int]) -> None:
        for tag in tags:
            self._call(self._ch.basic_nack, tag, requeue=True)

    def dead_letters(self, limit: int = 100) -> list[DeadLetterRecord]:
        """Taken from ``<queue>.dead`` unacked and given back at once."""
        got = self._peek_dead(limit)
        self._unhide([tag for tag, _, _ in got])
        return [rec for _, _, rec in got]

    def _put_back(self, broker_id: str) -> str | None:
        """Publish the body to ``<queue>`` (a consumer gives it a new id on its way to the work
        queue: delivery 1), then ack the dead letter: AMQP cannot mark it, so its reason is logged
        as the message's history. Returns "" (the new id is given when a consumer takes it)."""
        got = self._peek_dead(100_000)
        match = next(((tag, body, rec) for tag, body, rec in got if rec.broker_id == broker_id), None)
        try:
            if match is None:
                return None
            tag, body, rec = match
            props = pika.BasicProperties(delivery_mode=2, timestamp=int(time.time()))
            self._call(self._ch.basic_publish, "", self.name, body, props)
            self._call(self._ch.basic_ack, tag)
            logger.warning(
                "requeued: id=%s broker_id=%s; it was dead-lettered kind=%s deliveries=%d reason=%s",
                rec.id or "-",
                broker_id,
                rec.kind,
                rec.deliveries,
                " ".join(rec.reason.split())[:500],
            )
            return ""
        finally:
            self._unhide([tag for tag, _, rec in got if match is None or tag != match[0]])

    def extend(self, delivery: Delivery) -> None:
        """Nothing to do: an unacked message stays ours while the channel lives."""

    def reply(self, body: bytes) -> None:
        props = pika.BasicProperties(delivery_mode=2, content_type="application/json")
        self._call(self._ch.basic_publish, "", self.reply_queue, body, props)

    def send(self, body: bytes, message_id: str | None = None, traceparent: str | None = None) -> None:
        """Publish to ``<queue>`` (``message_id`` is the AMQP property: the producer's, never
        the message's identity; ``traceparent`` a header the traces read as untrusted)."""
        headers = {"traceparent": traceparent} if traceparent else None
        props = pika.BasicProperties(
            delivery_mode=2, message_id=message_id, timestamp=int(time.time()), headers=headers
        )
        self._call(self._ch.basic_publish, "", self.name, body, props)

    def send_traced(self, body: bytes, traceparent: str | None) -> None:
        """A message with a ``traceparent`` header."""
        self.send(body, traceparent=traceparent)

    def backlog(self) -> dict[str, int] | None:
        """The ready count of ``<queue>`` and ``<queue>.work``, from passive declares (unacked
        deliveries are not in it)."""
        ready = 0
        for name in (self.name, self.work_queue):
            ok = self._call(lambda n=name: self._ch.queue_declare(n, passive=True))
            ready += int(ok.method.message_count)
        return {"ready": ready}


def dead_reason(headers: dict[str, Any] | None) -> dict[str, Any]:
    """The :class:`DeadLetter` a dead-lettered message carries (empty for a broker-side reject)."""
    raw = (headers or {}).get("x-pandastack-dead")
    return json.loads(raw) if raw else {}


def _why(exc: BaseException) -> str:
    """pika's errors often have no text of their own: the cause is their first argument."""
    detail = str(exc) or (repr(exc.args[0]) if exc.args else "")
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _safe(url: str) -> str:
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{parts.hostname or ''}{port}", query=""))

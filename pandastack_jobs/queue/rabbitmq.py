"""RabbitMQ through pika: manual acks on a quorum queue, delay queues, a dead-letter exchange.

An unacked message stays with this consumer until it is acked or the channel
closes (then RabbitMQ requeues it: a killed worker's messages come back by
themselves), so there is no lease to extend; mind the broker's
``consumer_timeout`` (30 min by default) for longer jobs. A release publishes
the message (with its delivery count in a header) to ``<queue>.delay.<ms>``, a
queue whose TTL dead-letters it back into ``<queue>``, then acks the original;
every publish waits for the broker's confirm. Dead letters go to the exchange
``<queue>.dlx`` (also the queue's own dead-letter exchange) bound to ``<queue>.dead``.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import pika
import pika.exceptions

from .transport import BrokerUnavailable, DeadLetter, Delivery, Transport

_ERRORS = (pika.exceptions.AMQPError, OSError)
_DELAYS_MS = (0, 1000, 2000, 5000, 10000, 30000, 60000, 300000, 900000, 3600000)


class RabbitMQTransport(Transport):
    """``amqp://user:pass@host:port/vhost?queue=jobs`` (``amqps://`` for TLS)."""

    lease_seconds = None

    def __init__(self, url: str, lease_seconds: float | None = None) -> None:
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
        except _ERRORS as exc:
            raise BrokerUnavailable(f"RabbitMQ at {_safe(self._url)}: {_why(exc)}") from None
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
        out: list[Delivery] = []
        waited = 0.0
        while len(out) < max_messages:
            method, props, body = self._call(self._ch.basic_get, self.name, auto_ack=False)
            if method is None:
                if out or waited >= wait_seconds:
                    break
                self._call(self._conn.process_data_events, 0.1)  # type: ignore[union-attr]
                waited += 0.1
                continue
            headers = props.headers or {}
            count = int(headers.get("x-pandastack-prior", 0)) + int(headers.get("x-delivery-count", 0)) + 1
            mid = props.message_id or headers.get("x-pandastack-mid") or hashlib.sha256(body).hexdigest()[:24]
            # Producer-written (validated where used): the send time and the producer's trace context.
            extra = {"sent": props.timestamp, "traceparent": headers.get("traceparent")}
            out.append(
                Delivery(
                    str(mid),
                    body,
                    count,
                    handle=method.delivery_tag,
                    generation=self._generation,
                    extra=extra,
                )
            )
        return out

    def _publish(self, exchange: str, routing_key: str, delivery: Delivery, headers: dict[str, Any]) -> None:
        carried = {"traceparent": delivery.extra["traceparent"]} if delivery.extra.get("traceparent") else {}
        sent = delivery.extra.get("sent")
        props = pika.BasicProperties(
            delivery_mode=2,
            message_id=delivery.message_id,
            timestamp=sent if isinstance(sent, int) else None,
            headers={"x-pandastack-mid": delivery.message_id, **carried, **headers},
        )
        self._call(self._ch.basic_publish, exchange, routing_key, delivery.body, props, mandatory=False)

    def ack(self, delivery: Delivery) -> None:
        self._call(self._ch.basic_ack, delivery.handle)

    def release(self, delivery: Delivery, delay_seconds: float) -> None:
        ms = next((d for d in _DELAYS_MS if d >= delay_seconds * 1000), _DELAYS_MS[-1])
        target = self.name
        if ms:
            target = f"{self.name}.delay.{ms}"
            if ms not in self._delay_queues:
                args = {
                    "x-message-ttl": ms,
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": self.name,
                }
                self._call(self._ch.queue_declare, target, durable=True, arguments=args)
                self._delay_queues.add(ms)
        self._publish("", target, delivery, {"x-pandastack-prior": delivery.count})
        self.ack(delivery)

    def dead_letter(self, delivery: Delivery, why: DeadLetter) -> None:
        self._publish(self.dlx, "", delivery, {"x-pandastack-dead": why.to_json()})
        self.ack(delivery)

    def extend(self, delivery: Delivery) -> None:
        """Nothing to do: an unacked message stays ours while the channel lives."""

    def reply(self, body: bytes) -> None:
        props = pika.BasicProperties(delivery_mode=2, content_type="application/json")
        self._call(self._ch.basic_publish, "", self.reply_queue, body, props)

    def send(self, body: bytes, message_id: str | None = None, traceparent: str | None = None) -> None:
        headers = {"traceparent": traceparent} if traceparent else None
        props = pika.BasicProperties(
            delivery_mode=2, message_id=message_id, timestamp=int(time.time()), headers=headers
        )
        self._call(self._ch.basic_publish, "", self.name, body, props)

    def send_traced(self, body: bytes, traceparent: str | None) -> None:
        """A message with a ``traceparent`` header."""
        self.send(body, traceparent=traceparent)

    def backlog(self) -> dict[str, int] | None:
        """The queue's ready count, from a passive declare (unacked deliveries are not in it)."""
        ok = self._call(lambda: self._ch.queue_declare(self.name, passive=True))
        return {"ready": int(ok.method.message_count)}


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

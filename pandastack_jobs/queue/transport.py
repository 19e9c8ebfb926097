"""What the consumer needs from a broker: leased receive, ack, delayed release, dead-letter, lease
extension, a delivery count, and a reply destination.

Every transport is driven from one thread (the consumer's loop), so a client
that is not thread-safe (pika's BlockingConnection) is fine. A transport raises
:class:`BrokerUnavailable` when the broker cannot be reached; the consumer then
reconnects with backoff and keeps its running jobs.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any

from ..exceptions import PandaStackJobsError


class BrokerUnavailable(PandaStackJobsError, ConnectionError):
    """The broker cannot be reached (or dropped the connection); the message says which and why."""


class RecordRejected(PandaStackJobsError):
    """The broker refused THIS record (too large for the destination, or invalid), not the
    connection: sending it again gives the same answer, so the consumer dead-letters the message
    instead of reconnecting. The message names the destination, the record's size and the
    setting to raise; ``size`` is that size in bytes."""

    def __init__(self, message: str, size: int = 0) -> None:
        super().__init__(message)
        self.size = size


class LeaseLost(PandaStackJobsError):
    """The delivery is no longer ours (its lease ran out and another consumer took it, or the broker
    forgot it): nothing to settle here; the broker redelivers it, or already has."""


@dataclass
class Delivery:
    """One delivery of one message. ``count`` is 1 on the first delivery, 2 on the next, ...

    ``message_id`` is the BROKER's identity of the message: the same on every delivery (also
    across a transport's own delayed re-publish), unique per message in its queue, and never
    taken from anything a producer can write; it names, reaps and fences the message's
    sandboxes. ``count`` comes from the broker or from a structure only consumers write.
    ``handle`` is whatever the transport needs to ack it. ``malformed``: ``(field, problem)``
    when the transport found something a producer may not set (a consumer bookkeeping field or
    header): the consumer dead-letters the message, kind ``malformed``, naming that field.
    """

    message_id: str
    body: bytes
    count: int
    handle: Any = None
    generation: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    malformed: tuple[str, str] | None = None


MAX_DEAD_LETTER_BYTES = 64 * 1024
"""A dead letter's JSON at most: one header frame of every broker holds it (RabbitMQ's is 128 KiB)."""
_UNSTORABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ud800-\udfff\ufffe\uffff]")


def one_line(text: str, limit: int) -> str:
    """A producer's text as one printable line of at most ``limit`` characters: control
    characters escaped (a newline in a field name would forge a log line), lone surrogates too."""
    text = text[: limit * 4]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def stored_text(text: str) -> str:
    """Multi-line text (a reason, an output tail) every store takes: NUL (PostgreSQL's jsonb refuses
    it), other control characters but newline and tab, lone surrogates and U+FFFE/U+FFFF (SQS
    refuses them in an attribute) become U+FFFD."""
    return _UNSTORABLE.sub("\ufffd", text)


@dataclass(frozen=True)
class DeadLetter:
    """Why a message went to the dead-letter destination; stored with the original body.

    Its text is a producer's and a job's: bounded and cleaned here, once for every transport
    (a header frame, a jsonb column and a log line each refuse something else)."""

    reason: str
    kind: str
    field: str | None = None
    deliveries: int = 0
    stdout_tail: str = ""
    stderr_tail: str = ""
    # Both ids, so a reader finds the dead letter by either: the message's own ``id`` (the
    # producer's correlation id, None when it has none) and the broker's id (its identity).
    id: str | None = None
    broker_id: str = ""

    def __post_init__(self) -> None:
        reason = stored_text(self.reason)
        clean = {
            "reason": reason if len(reason) <= 4000 else reason[:3999] + "…",
            "kind": one_line(self.kind, 64),
            "field": None if self.field is None else one_line(self.field, 120),
            "stdout_tail": stored_text(self.stdout_tail[-2000:]),
            "stderr_tail": stored_text(self.stderr_tail[-2000:]),
            "id": None if self.id is None else one_line(self.id, 256),
            "broker_id": one_line(self.broker_id, 256),
        }
        for name, value in clean.items():
            object.__setattr__(self, name, value)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """At most :data:`MAX_DEAD_LETTER_BYTES` (ASCII): the tails and the reason are halved
        until it fits (escaped characters take up to 12 bytes each)."""
        doc = self.as_dict()
        text = json.dumps(doc)
        while len(text) > MAX_DEAD_LETTER_BYTES:
            for name in ("stdout_tail", "stderr_tail"):
                doc[name] = doc[name][len(doc[name]) // 2 :]
            doc["reason"] = doc["reason"][: len(doc["reason"]) // 2]
            text = json.dumps(doc)
        return text


class UnknownDeadLetter(PandaStackJobsError, LookupError):
    """``requeue`` was given an id no dead letter of this queue has."""


class DeadLettersUnsupported(PandaStackJobsError, NotImplementedError):
    """The transport cannot list or requeue its dead letters; the message names the broker."""


@dataclass(frozen=True)
class DeadLetterRecord:
    """One stored dead letter, as ``pandastack-jobs dead-letters`` lists it. ``broker_id`` is the
    message's identity on the broker (what ``requeue`` takes); ``id`` is the producer's
    correlation id from the body (None when it has none); ``at`` is when it was dead-lettered
    (epoch seconds, None where the broker does not say)."""

    broker_id: str
    id: str | None
    kind: str
    reason: str
    field: str | None
    deliveries: int
    at: float | None
    body: bytes = b""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["body"] = self.body.decode("utf-8", "replace")
        return out

    @classmethod
    def stored(
        cls, broker_id: str, body: bytes, why: dict[str, Any] | str | bytes | None, at: float | None
    ) -> DeadLetterRecord:
        """The record of a stored body and its ``why``: the :meth:`DeadLetter.to_json` text as the
        broker kept it, or already parsed. Any shape is read (a dead letter an older consumer or
        the broker itself wrote has fewer fields; one that is not a JSON object, none), so every
        transport reads its store the same way."""
        if not isinstance(why, dict):
            try:
                why = json.loads(why or "{}")
            # UnicodeDecodeError is a ValueError; TypeError: a header of another type (AMQP's).
            except (TypeError, ValueError, RecursionError):
                why = {}
        fields: dict[str, Any] = why if isinstance(why, dict) else {}
        deliveries, ident, field_ = fields.get("deliveries"), fields.get("id"), fields.get("field")
        return cls(
            broker_id=str(fields.get("broker_id") or broker_id),
            id=ident if isinstance(ident, str) else correlation_id(body),
            kind=str(fields.get("kind") or "unknown"),
            reason=str(fields.get("reason") or "(no reason recorded)"),
            field=field_ if isinstance(field_, str) else None,
            deliveries=deliveries if isinstance(deliveries, int) else 0,
            at=at,
            body=body,
        )


def body_string(body: bytes, name: str) -> str | None:
    """The string field ``name`` of a JSON-object body, else None; never raises: the body is the
    producer's (not JSON, not UTF-8, or nested past the parser: RecursionError)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    found = doc.get(name) if isinstance(doc, dict) else None
    return found if isinstance(found, str) else None


def correlation_id(body: bytes) -> str | None:
    """The ``id`` a producer put in the JSON body, if any (bounded; never raises)."""
    found = body_string(body[: 1024 * 1024], "id")
    return found[:256] if found is not None else None


class Transport(ABC):
    """One queue on one broker. ``name`` names the queue in job keys and logs."""

    name: str
    # How long a receive holds a message before the broker may hand it to someone else
    # (None: held until the connection ends, as RabbitMQ does).
    lease_seconds: float | None
    # What else, beside ``name``, a broker id is unique within (PostgreSQL: the table, whose row
    # ids restart in every table; Redis: the database): part of every job key.
    key_scope: str = ""
    # The largest body a receive reads into memory (the consumer sets its ``max_message_bytes``);
    # a transport that can tell a body's size before reading it hands out a larger one empty and
    # malformed (field ``body``), so the bound holds before the bytes reach the consumer. None: any.
    max_body_bytes: int | None = None

    @abstractmethod
    def receive(self, max_messages: int, wait_seconds: float) -> list[Delivery]:
        """Up to ``max_messages`` deliveries, each leased to this consumer; waits at most ``wait_seconds``."""

    @abstractmethod
    def ack(self, delivery: Delivery) -> None:
        """The message is done: remove it for good."""

    @abstractmethod
    def release(self, delivery: Delivery, delay_seconds: float) -> None:
        """Give the message back for redelivery after at least ``delay_seconds``."""

    @abstractmethod
    def dead_letter(self, delivery: Delivery, why: DeadLetter) -> None:
        """Move the message, with ``why``, to the dead-letter destination (then it is gone here)."""

    @abstractmethod
    def extend(self, delivery: Delivery) -> None:
        """Renew the lease of a message still being worked on."""

    @abstractmethod
    def reply(self, body: bytes) -> None:
        """Publish a result to the queue's reply destination."""

    def connect(self) -> None:  # noqa: B027 - optional
        """(Re)connect; called after :class:`BrokerUnavailable`. Raises it again if still down."""

    def heartbeat(self) -> None:  # noqa: B027 - optional
        """Called on every turn of the loop: service the connection (RabbitMQ's heartbeats)."""

    def wake(self) -> None:  # noqa: B027 - optional
        """The consumer is stopping (its ``stop()``, maybe from a signal handler: only set a flag
        here): a receive that may wait past its ``wait_seconds`` (Kafka's first, for the group's
        join) ends at its own wait instead, so a SIGTERM is not held by it."""

    @abstractmethod
    def send(self, body: bytes, message_id: str | None = None) -> None:
        """Enqueue a message (the producer's side: the examples, the tests, ``pandastack-jobs send``)."""

    def send_traced(self, body: bytes, traceparent: str | None) -> None:
        """:meth:`send`, carrying the producer's W3C ``traceparent`` where the broker has a place for it
        (pandastack_jobs/tracing.py); by default it is dropped."""
        self.send(body)

    def backlog(self) -> dict[str, int] | None:
        """Messages waiting, by state (``ready``, ``delayed``, ``leased``), where the broker tells it
        in one cheap call; None where it cannot (the consumer's metrics then leave it out)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional
        """Release the connection."""

    def dead_letters(self, limit: int = 100) -> list[DeadLetterRecord]:
        """Up to ``limit`` dead letters still waiting (oldest first); requeued ones are left out."""
        raise DeadLettersUnsupported(f"{type(self).__name__}: listing dead letters is not supported")

    def requeue(self, broker_id: str) -> str:
        """Put the dead letter of ``broker_id`` back on the queue as a NEW message (a fresh broker
        id, delivery count from 1) and return the new broker id where the broker tells it (else
        ""). The dead letter's reason stays in the dead-letter store, marked requeued, or where
        the broker cannot mark it, in the log. Raises :class:`UnknownDeadLetter` (one message for
        every broker) when :meth:`_put_back` finds none."""
        new = self._put_back(broker_id)
        if new is None:
            raise UnknownDeadLetter(
                f"no dead letter of queue {self.name!r} has broker id {broker_id!r}"
                " (`pandastack-jobs dead-letters --broker URL` lists them)"
            )
        return new

    def _put_back(self, broker_id: str) -> str | None:
        """The broker's part of :meth:`requeue`: the new broker id (or ""), or None when no dead
        letter still waiting has ``broker_id`` (none, or already requeued)."""
        raise DeadLettersUnsupported(f"{type(self).__name__}: requeueing dead letters is not supported")

    def lost(self, delivery: Delivery) -> bool:
        """True when ``delivery`` came over a connection that has since been lost: it cannot be
        acked any more and the broker will redeliver it."""
        return False

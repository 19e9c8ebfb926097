"""Queue workers: consume a broker, one sandbox per message, ack only after the result is out.

:class:`Consumer` drives any :class:`Transport`; :func:`open_transport` builds
one from a URL whose scheme :data:`BROKERS` maps to the transport's class
(``redis://``, ``postgresql://``, ``amqp://``, ``sqs://``, ``kafka://``,
``memory://``). Each transport's module, and so its client library, is imported
only when its scheme is used (the ``[queue]`` extra: ``pip install '.[queue]'`` in a clone).
docs/queues.md has the message format; docs/architecture.md ("A new broker")
how to add a broker.
"""

from __future__ import annotations

import importlib
from typing import cast
from urllib.parse import urlsplit

from .consumer import (
    CONSUMER_DEFAULTS,
    Consumer,
    ConsumerSettings,
    Runner,
    Sink,
    Stats,
    batch_done,
    reply_sink,
)
from .message import FORMAT, MessageError, QueueJob, parse
from .transport import BrokerUnavailable, DeadLetter, Delivery, LeaseLost, Transport

BROKERS: dict[str, str] = {
    "redis": "pandastack_jobs.queue.redis_streams:RedisStreamsTransport",
    "rediss": "pandastack_jobs.queue.redis_streams:RedisStreamsTransport",
    "postgresql": "pandastack_jobs.queue.postgres:PostgresTransport",
    "postgres": "pandastack_jobs.queue.postgres:PostgresTransport",
    "amqp": "pandastack_jobs.queue.rabbitmq:RabbitMQTransport",
    "amqps": "pandastack_jobs.queue.rabbitmq:RabbitMQTransport",
    "sqs": "pandastack_jobs.queue.sqs:SQSTransport",
    "kafka": "pandastack_jobs.queue.kafka:KafkaTransport",
    "memory": "pandastack_jobs.queue.memory:MemoryTransport",
}
"""URL scheme -> ``module:Class`` of its :class:`Transport` (``Class(url, lease_seconds)``). A
third-party broker adds its own entry, e.g. ``BROKERS["nats"] = "mypkg.nats:NatsTransport"``."""

SCHEMES = tuple(BROKERS)
"""The schemes :func:`open_transport` knows (derived from :data:`BROKERS`, for messages)."""


def transport_class(scheme: str) -> type[Transport]:
    """The :class:`Transport` class registered for ``scheme`` (its module imported now)."""
    try:
        target = BROKERS[scheme]
    except KeyError:
        known = ", ".join(BROKERS)
        raise ValueError(f"broker URL scheme {scheme!r} is not one of {known}") from None
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise ValueError(f"BROKERS[{scheme!r}] = {target!r} does not name a Transport class")
    return cast("type[Transport]", cls)


def open_transport(url: str, lease_seconds: float = CONSUMER_DEFAULTS.lease_seconds) -> Transport:
    """The transport for a broker URL (not yet connected: call ``connect()``)."""
    cls = transport_class(urlsplit(url).scheme)
    return cls(url, lease_seconds)  # type: ignore[call-arg]


__all__ = [
    "BROKERS",
    "CONSUMER_DEFAULTS",
    "FORMAT",
    "SCHEMES",
    "BrokerUnavailable",
    "Consumer",
    "ConsumerSettings",
    "DeadLetter",
    "Delivery",
    "LeaseLost",
    "MessageError",
    "QueueJob",
    "Runner",
    "Sink",
    "Stats",
    "Transport",
    "batch_done",
    "open_transport",
    "parse",
    "reply_sink",
    "transport_class",
]

"""Queue workers: consume a broker, one sandbox per message, ack only after the result is out.

:class:`Consumer` drives any :class:`Transport`; :func:`open_transport` builds
one from a URL (``redis://``, ``postgresql://``, ``amqp://``, ``sqs://``). Each
transport's client library is imported only when its scheme is used
(the ``[queue]`` extra: ``pip install '.[queue]'`` in a clone). docs/queues.md has the message format.
"""

from __future__ import annotations

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

SCHEMES = ("redis", "rediss", "postgresql", "postgres", "amqp", "amqps", "sqs")


def open_transport(url: str, lease_seconds: float = CONSUMER_DEFAULTS.lease_seconds) -> Transport:
    """The transport for a broker URL (not yet connected: call ``connect()``)."""
    scheme = urlsplit(url).scheme
    if scheme in ("redis", "rediss"):
        from .redis_streams import RedisStreamsTransport

        return RedisStreamsTransport(url, lease_seconds)
    if scheme in ("postgresql", "postgres"):
        from .postgres import PostgresTransport

        return PostgresTransport(url, lease_seconds)
    if scheme in ("amqp", "amqps"):
        from .rabbitmq import RabbitMQTransport

        return RabbitMQTransport(url)
    if scheme == "sqs":
        from .sqs import SQSTransport

        return SQSTransport(url, lease_seconds)
    raise ValueError(f"broker URL scheme {scheme!r} is not one of {', '.join(SCHEMES)}")


__all__ = [
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
]

"""Signed consumer bookkeeping: the stamp a transport puts on a message it re-publishes (RabbitMQ's
work queue, Kafka's retry topic), so that a producer who can write there cannot set a message's
identity or delivery count.

A stamp is HMAC-SHA256, under a per-queue key, over the message id, its deliveries so far, the
SHA-256 of its body and any further fields the transport reads (Kafka's not-before time). The
key is HMAC(secret, queue name); the secret is ``secret=``, else ``$PANDASTACK_QUEUE_SECRET``,
else the PandaStack API key (``$PANDASTACK_API_KEY``: every consumer holds it, no producer may).
Only signatures reach the broker, never the key or the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os

MAX_PRIOR = 1_000_000
"""The most deliveries a stamp may carry (a larger count is not a consumer's)."""


class Stamper:
    """Signs and checks the stamps of one queue (``queue``: its name, part of the key)."""

    def __init__(self, queue: str, secret: str | None = None) -> None:
        secret = secret or os.environ.get("PANDASTACK_QUEUE_SECRET") or os.environ.get("PANDASTACK_API_KEY")
        self.signed = bool(secret)
        """False without any secret: the stamps are then not secret (only permissions guard)."""
        self._key = hmac.new(
            (secret or "").encode(), b"pandastack-queue-stamp\x1f" + queue.encode(), "sha256"
        ).digest()

    def sign(self, mid: str, prior: int, body: bytes, *more: str) -> str:
        """The stamp of message ``mid`` after ``prior`` deliveries, with ``body`` and ``more``."""
        raw = f"{mid}\x1f{prior}\x1f".encode() + hashlib.sha256(body).digest()
        for field in more:  # none for RabbitMQ: its stamps are the same bytes as before
            raw += b"\x1f" + field.encode()
        return hmac.new(self._key, raw, "sha256").hexdigest()

    def verify(self, sig: object, mid: object, prior: object, body: bytes, *more: str) -> bool:
        """Whether ``sig`` is this queue's stamp of the others (any types: they are read from the
        broker, and anything but a consumer's own stamp is False; never raises)."""
        if not (
            isinstance(mid, str)
            and mid
            and isinstance(prior, int)
            and not isinstance(prior, bool)
            and 0 <= prior < MAX_PRIOR
            and isinstance(sig, (str, bytes))
        ):
            return False
        given = sig if isinstance(sig, bytes) else sig.encode("utf-8", "replace")
        return hmac.compare_digest(self.sign(mid, prior, body, *more).encode(), given)

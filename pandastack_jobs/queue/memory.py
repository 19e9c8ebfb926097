"""``memory://NAME``: a broker in this process's memory, for unit tests and trying the consumer
without a broker.

Everything lives in one :class:`MemoryTransport` object (two transports opened
on the same URL do not share messages); nothing survives the process. A
release with a delay is due after it; the delivery count is kept per message id.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from .transport import DeadLetter, DeadLetterRecord, Delivery, Transport


class MemoryTransport(Transport):
    """``memory://NAME``. ``acked``, ``released``, ``dead`` and ``replies`` record what the
    consumer did, for a test to read."""

    lease_seconds: float | None = None

    def __init__(self, url: str = "memory://mem", lease_seconds: float | None = None) -> None:
        self.name = urlsplit(url).netloc or "mem"
        self.waiting: list[tuple[float, Delivery]] = []  # (due, delivery)
        self.acked: list[str] = []
        self.released: list[str] = []
        self.dead: list[tuple[str, DeadLetter]] = []
        self.replies: list[dict[str, Any]] = []
        self.counts: dict[str, int] = {}
        # The dead letters' bodies and when they died, and which were requeued (as what): kept for
        # dead_letters()/requeue(), beside ``dead``.
        self._dead_store: list[tuple[str, bytes, DeadLetter, float]] = []
        self.requeued: dict[str, str] = {}
        self._lock = threading.Lock()  # a test's thread sends while the consumer's loop receives
        self._next_id = 0

    def put(self, body: dict[str, Any]) -> None:
        """Send ``body`` as JSON under its own ``id`` as the message id (a test's shorthand)."""
        self.send(json.dumps(body).encode(), body["id"])

    def send(self, body: bytes, message_id: str | None = None) -> None:
        with self._lock:
            mid = message_id or f"m{self._next_id}"
            self._next_id += 1
            self.counts.setdefault(mid, 0)
            self.waiting.append((0.0, Delivery(mid, body, 0)))

    def receive(self, max_messages: int, wait_seconds: float) -> list[Delivery]:
        deadline = time.monotonic() + wait_seconds
        while True:
            with self._lock:
                now = time.monotonic()
                due = [d for at, d in self.waiting if at <= now][:max_messages]
                if due:
                    self.waiting = [(at, d) for at, d in self.waiting if d not in due]
                    for d in due:
                        self.counts[d.message_id] += 1
                        d.count = self.counts[d.message_id]
                    return due
            if time.monotonic() >= deadline:
                return []
            time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))

    def ack(self, delivery: Delivery) -> None:
        self.acked.append(delivery.message_id)

    def release(self, delivery: Delivery, delay_seconds: float) -> None:
        with self._lock:
            self.released.append(delivery.message_id)
            due = time.monotonic() + max(0.0, delay_seconds)
            self.waiting.append((due, Delivery(delivery.message_id, delivery.body, 0)))

    def dead_letter(self, delivery: Delivery, why: DeadLetter) -> None:
        self.dead.append((delivery.message_id, why))
        self._dead_store.append((delivery.message_id, delivery.body, why, time.time()))

    def dead_letters(self, limit: int = 100) -> list[DeadLetterRecord]:
        with self._lock:
            kept = [d for d in self._dead_store if d[0] not in self.requeued]
        return [DeadLetterRecord.stored(mid, body, why.as_dict(), at) for mid, body, why, at in kept[:limit]]

    def _put_back(self, broker_id: str) -> str | None:
        """A new message with the dead letter's body (a new id, delivery 1); the dead letter stays,
        marked in ``requeued``."""
        with self._lock:
            found = next((d for d in self._dead_store if d[0] == broker_id), None)
            if found is None or broker_id in self.requeued:
                return None
            new = f"m{self._next_id}"
        self.send(found[1], new)
        with self._lock:
            self.requeued[broker_id] = new
        return new

    def extend(self, delivery: Delivery) -> None:
        """Nothing to do: a received message is held until it is settled."""

    def reply(self, body: bytes) -> None:
        self.replies.append(json.loads(body))

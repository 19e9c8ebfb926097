"""The queue scenario of the e2e engines: messages on a real Redis stream, and what the broker holds
afterwards (replies, dead letters, what is still queued, delayed or leased), read with redis-py.

The queues live in database 1 of the e2e Redis (database 0 is Celery's broker).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import redis as redis_py

from .services import Redis

QUEUE_DB = 1
# Fails redeliverably on its first delivery (exit 75, "try again later"), succeeds on the next.
FLAKY = (
    '[ "$QUEUE_DELIVERY" -ge 2 ] || { echo "upstream unavailable" >&2; exit 75; }; '
    'printf \'{"id": "%s", "delivery": %s}\' "$QUEUE_MESSAGE_ID" "$QUEUE_DELIVERY" > "$JOB_RESULT"'
)
GOOD = 'printf \'{"id": "%s", "delivery": %s}\' "$QUEUE_MESSAGE_ID" "$QUEUE_DELIVERY" > "$JOB_RESULT"'
DEFAULTS = {"template": "base", "timeout": 60}


@dataclass
class Stream:
    """One fresh queue (a stream and its ``:results``, ``:dead`` and ``:delayed`` keys)."""

    redis: Redis
    name: str

    @classmethod
    def fresh(cls, redis: Redis, prefix: str) -> Stream:
        return cls(redis, f"{prefix}-{uuid.uuid4().hex[:8]}")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.redis.port}/{QUEUE_DB}?stream={self.name}"

    def _r(self) -> Any:
        return redis_py.Redis(host="127.0.0.1", port=self.redis.port, db=QUEUE_DB, socket_timeout=10)

    def send_scenario(self) -> None:
        """``good`` (acked on delivery 1), ``flaky`` (redelivered, then acked on delivery 2),
        ``poison`` (a permanent exit code: dead-lettered at once)."""
        docs = [
            {"id": "good", "command": GOOD},
            {"id": "flaky", "command": FLAKY},
            {
                "id": "poison",
                "command": "echo 'bad input' >&2; exit 4",
                "options": {"permanent_exit_codes": [4]},
            },
        ]
        r = self._r()
        try:
            for doc in docs:
                r.xadd(self.name, {"body": json.dumps(doc)})  # body only: other fields are refused
        finally:
            r.close()

    def results(self) -> list[dict[str, Any]]:
        r = self._r()
        try:
            return [json.loads(f[b"body"]) for _, f in r.xrange(f"{self.name}:results")]
        finally:
            r.close()

    def dead(self) -> list[dict[str, Any]]:
        r = self._r()
        try:
            return [
                {
                    "id": json.loads(f[b"body"])["id"],
                    "body": json.loads(f[b"body"]),
                    "why": json.loads(f[b"why"]),
                }
                for _, f in r.xrange(f"{self.name}:dead")
            ]
        finally:
            r.close()

    def delayed(self) -> list[tuple[dict[str, Any], float]]:
        """Released messages waiting for their redelivery, with the time they are due."""
        r = self._r()
        try:
            members = r.zrange(f"{self.name}:delayed", 0, -1, withscores=True)
            return [(json.loads(m), score) for m, score in members]
        finally:
            r.close()

    def depth(self) -> dict[str, int]:
        """What is still on the broker: entries in the stream, leased (pending) and delayed ones."""
        r = self._r()
        try:
            try:
                pending = r.xpending(self.name, "pandastack")["pending"]
            except redis_py.ResponseError:  # no consumer group yet: nothing leased
                pending = 0
            return {
                "stream": int(r.xlen(self.name)),
                "pending": int(pending),
                "delayed": int(r.zcard(f"{self.name}:delayed")),
            }
        finally:
            r.close()


def results_by_id(stream: Stream) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for doc in stream.results():
        out.setdefault(doc["id"], []).append(doc["result"])
    return out

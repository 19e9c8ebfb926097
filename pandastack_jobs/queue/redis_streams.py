"""Redis Streams: a consumer group, ``XACK`` after the result, ``XAUTOCLAIM`` of entries a dead
consumer left, a ``<stream>:dead`` stream and a ``<stream>:results`` reply stream.

Streams have no delayed redelivery: a release moves the entry to a sorted set
``<stream>:delayed`` scored by its due time (in one MULTI with the XACK), and
each receive moves the due ones back with a Lua script. The delivery count is
the group's ``times_delivered`` plus what earlier entries of the message had.
Without persistence (AOF or RDB) a Redis restart loses the stream: run Redis
with ``appendonly yes`` for a queue.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis

from .transport import BrokerUnavailable, DeadLetter, Delivery, Transport

_PROMOTE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, 100)
for _, m in ipairs(due) do
  if redis.call('ZREM', KEYS[2], m) == 1 then
    local d = cjson.decode(m)
    redis.call('XADD', KEYS[1], '*', 'body', d.body, 'mid', d.mid, 'prior', d.prior,
               'sent', d.sent or '', 'traceparent', d.tp or '')
  end
end
return #due
"""
_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class RedisStreamsTransport(Transport):
    """``redis://host:port/db?stream=jobs&group=pandastack`` (``rediss://`` for TLS)."""

    def __init__(self, url: str, lease_seconds: float = 60.0, consumer: str | None = None) -> None:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.stream = query.pop("stream", "pandastack-jobs")
        self.group = query.pop("group", "pandastack")
        self.name = self.stream
        self.lease_seconds = lease_seconds
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._url = urlunsplit(parts._replace(query="&".join(f"{k}={v}" for k, v in query.items())))
        self.dead_stream, self.reply_stream = f"{self.stream}:dead", f"{self.stream}:results"
        self._delayed = f"{self.stream}:delayed"
        self._r: redis.Redis | None = None

    # -- connection ------------------------------------------------------------------------------

    def connect(self) -> None:
        self.close()
        r = redis.Redis.from_url(self._url, socket_connect_timeout=10, socket_timeout=10)
        try:
            try:
                r.xgroup_create(self.stream, self.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        except _ERRORS as exc:
            r.close()
            raise BrokerUnavailable(f"Redis at {_safe(self._url)}: {exc}") from None
        self._r = r
        self._promote = r.register_script(_PROMOTE)

    def close(self) -> None:
        if self._r is not None:
            self._r.close()
            self._r = None

    def _redis(self) -> redis.Redis:
        if self._r is None:
            raise BrokerUnavailable("Redis: not connected")
        return self._r

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _ERRORS as exc:
            raise BrokerUnavailable(f"Redis at {_safe(self._url)}: {exc}") from None

    # -- the queue -------------------------------------------------------------------------------

    def receive(self, max_messages: int, wait_seconds: float) -> list[Delivery]:
        r = self._redis()
        self._call(self._promote, keys=[self.stream, self._delayed], args=[time.time()])
        lease_ms = int((self.lease_seconds or 60) * 1000)
        # [next id, entries] (Redis 6.2), [next id, entries, deleted ids] (Redis 7)
        claimed = self._call(
            r.xautoclaim, self.stream, self.group, self.consumer, lease_ms, "0-0", count=max_messages
        )[1]
        out = [self._delivery(eid, fields, claimed=True) for eid, fields in claimed if fields]
        if len(out) < max_messages:
            got = self._call(
                r.xreadgroup,
                self.group,
                self.consumer,
                {self.stream: ">"},
                count=max_messages - len(out),
                block=max(1, int(wait_seconds * 1000)),
            )
            for _, entries in got or []:
                out.extend(self._delivery(eid, fields, claimed=False) for eid, fields in entries)
        return out

    def _delivery(self, eid: bytes, fields: dict[bytes, bytes], claimed: bool) -> Delivery:
        times = 1
        if claimed:
            info = self._call(self._redis().xpending_range, self.stream, self.group, eid, eid, 1)
            times = int(info[0]["times_delivered"]) if info else 1
        entry_id = eid.decode()
        prior = int(fields.get(b"prior", b"0") or 0)
        mid = fields.get(b"mid", b"").decode() or entry_id
        # Producer-written (the metrics and traces validate them): when it was first sent, its trace.
        extra = {
            "sent": fields.get(b"sent") or entry_id.split("-")[0],
            "traceparent": fields.get(b"traceparent"),
        }
        return Delivery(mid, fields.get(b"body", b""), prior + times, handle=entry_id, extra=extra)

    def _settle(self, delivery: Delivery, *extra: tuple[str, Any]) -> None:
        """In one MULTI: the extra commands, then XACK and XDEL of the entry."""
        pipe = self._redis().pipeline(transaction=True)
        for name, args in extra:
            getattr(pipe, name)(*args)
        pipe.xack(self.stream, self.group, delivery.handle)
        pipe.xdel(self.stream, delivery.handle)
        self._call(pipe.execute)

    def ack(self, delivery: Delivery) -> None:
        self._settle(delivery)

    def release(self, delivery: Delivery, delay_seconds: float) -> None:
        sent, tp = _text(delivery.extra.get("sent")), _text(delivery.extra.get("traceparent"))
        fields = {
            "body": delivery.body,
            "mid": delivery.message_id,
            "prior": str(delivery.count),
            "sent": sent,
            "traceparent": tp,
        }
        if delay_seconds <= 0:
            self._settle(delivery, ("xadd", (self.stream, fields)))
            return
        member = json.dumps(
            {
                "body": delivery.body.decode(),
                "mid": delivery.message_id,
                "prior": delivery.count,
                "sent": sent,
                "tp": tp,
            }
        )
        self._settle(delivery, ("zadd", (self._delayed, {member: time.time() + delay_seconds})))

    def dead_letter(self, delivery: Delivery, why: DeadLetter) -> None:
        fields = {"body": delivery.body, "mid": delivery.message_id, "why": why.to_json()}
        self._settle(delivery, ("xadd", (self.dead_stream, fields)))

    def extend(self, delivery: Delivery) -> None:
        # XCLAIM to ourselves resets the entry's idle time; JUSTID leaves its delivery count alone.
        r = self._redis()
        self._call(r.xclaim, self.stream, self.group, self.consumer, 0, [delivery.handle], justid=True)

    def reply(self, body: bytes) -> None:
        r = self._redis()
        self._call(r.xadd, self.reply_stream, {"body": body}, maxlen=1_000_000, approximate=True)

    def send(self, body: bytes, message_id: str | None = None) -> None:
        fields = {"body": body, **({"mid": message_id} if message_id else {})}
        self._call(self._redis().xadd, self.stream, fields)

    def send_traced(self, body: bytes, traceparent: str | None) -> None:
        """An entry with a ``traceparent`` field (the W3C trace context of the producer's span)."""
        self._call(
            self._redis().xadd,
            self.stream,
            {"body": body, **({"traceparent": traceparent} if traceparent else {})},
        )

    def backlog(self) -> dict[str, int] | None:
        """From XINFO GROUPS (the group's lag and pending count) and the delayed set's size."""
        r = self._redis()
        groups = self._call(r.xinfo_groups, self.stream)
        mine = next((g for g in groups if _text(g.get("name")) == self.group), None)
        if mine is None:
            return None
        out = {"leased": int(mine.get("pending") or 0), "delayed": int(self._call(r.zcard, self._delayed))}
        if mine.get("lag") is not None:  # Redis 7; None when the group's position is unknown
            out["ready"] = int(mine["lag"])
        return out


def _text(value: object) -> str:
    """A field Redis returned (bytes) or a value carried forward, as text ("" for none)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)


def _safe(url: str) -> str:
    """The URL without a password (for messages and logs)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{host}{port}", query=""))

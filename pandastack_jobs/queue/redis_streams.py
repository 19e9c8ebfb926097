"""Redis Streams: a consumer group, ``XACK`` after the result, ``XAUTOCLAIM`` of entries a dead
consumer left, a ``<stream>:dead`` stream and a ``<stream>:results`` reply stream.

Streams have no delayed redelivery: a release moves the entry to a sorted set
``<stream>:delayed`` scored by its due time (in one MULTI with the XACK), and
each receive moves the due ones back with a Lua script. A re-added entry gets a
new entry id, so the message's identity (its first entry id) and what earlier
entries of it were delivered live in the consumer-owned hash ``<stream>:ids``
(new entry id -> ``{"mid", "prior"}``), written by the same script as the
entry: an entry's own fields are the producer's, and an entry with any field
but ``body`` is dead-lettered, naming it. The delivery count is the group's
``times_delivered`` (the pending list) plus ``prior``. Without persistence (AOF
or RDB) a Redis restart loses the stream: run Redis with ``appendonly yes``.

A receive runs ``XAUTOCLAIM`` and ``XREADGROUP`` inside a Lua script that empties, on
Redis's side, any field value over ``max_body_bytes`` and returns its size instead: an
oversized body never reaches the consumer (it is dead-lettered, malformed, field ``body``,
and the dead letter copies the whole body on Redis's side too). Scripts cannot block, so an
idle receive polls the script every 0.1 s until its wait is over.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis

from .transport import BrokerUnavailable, DeadLetter, DeadLetterRecord, Delivery, Transport

logger = logging.getLogger(__name__)

# KEYS: stream, delayed, ids. Re-add the due messages; each new entry's bookkeeping goes to the
# consumer-owned hash in the same script (a producer can write entry fields, not that hash).
_PROMOTE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, 100)
for _, m in ipairs(due) do
  -- The XADD first: if it fails (a stream at its last possible id), nothing was removed yet.
  local d = cjson.decode(m)
  local id = redis.call('XADD', KEYS[1], '*', 'body', d.body,
                        'sent', d.sent or '', 'traceparent', d.tp or '')
  redis.call('ZREM', KEYS[2], m)
  redis.call('HSET', KEYS[3], id, cjson.encode({mid = d.mid, prior = d.prior}))
end
return #due
"""
# KEYS: stream, ids. ARGV: group, entry id, body, mid, prior, sent, traceparent. Re-add the message
# and settle the entry at once, its bookkeeping with it. The XADD first: Lua does not roll back, and
# an XADD can fail (a producer's entry at the stream's last possible id): then nothing is settled.
_READD = """
local id = redis.call('XADD', KEYS[1], '*', 'body', ARGV[3], 'sent', ARGV[6], 'traceparent', ARGV[7])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[2], id, cjson.encode({mid = ARGV[4], prior = tonumber(ARGV[5])}))
return id
"""
# KEYS: stream. ARGV: group, consumer, lease ms, count, cap (-1: none). The entries a dead consumer
# left (XAUTOCLAIM), then new ones (XREADGROUP; it does not block in a script): each as {id, fields,
# oversized, claimed}. A field value over the cap, or every value of an entry whose values together
# pass it, is emptied here, its name and size listed in ``oversized``, so its bytes never leave
# Redis; a field name over 256 bytes is cut to 64.
_RECEIVE = """
local cap, n = tonumber(ARGV[5]), tonumber(ARGV[4])
local out = {}
local function take(entries, claimed)
  for _, e in ipairs(entries) do
    local fields = e[2]
    if fields then
      local kept, over, total = {}, {}, 0
      for i = 2, #fields, 2 do total = total + #fields[i] end
      for i = 1, #fields, 2 do
        local name, value = fields[i], fields[i + 1]
        if cap >= 0 and #name > 256 then name = string.sub(name, 1, 64) end
        if cap >= 0 and (#value > cap or total > cap) then
          table.insert(over, name)
          table.insert(over, #value)
          value = ''
        end
        table.insert(kept, name)
        table.insert(kept, value)
      end
      table.insert(out, {e[1], kept, over, claimed})
    end
  end
end
local claimed = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], '0-0', 'COUNT', n)
take(claimed[2], 1)
if #out < n then
  local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n - #out, 'STREAMS', KEYS[1], '>')
  if got then take(got[1][2], 0) end
end
return out
"""
# KEYS: stream, dead, ids. ARGV: group, entry id, mid, why, body. Dead-letter the entry with its own
# body, copied on Redis's side (a body too large to receive was never read), else the one given.
_DEAD = """
local body = ARGV[5]
local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if e[1] then
  local f = e[1][2]
  for i = 1, #f, 2 do
    if f[i] == 'body' then body = f[i + 1] end
  end
end
redis.call('XADD', KEYS[2], '*', 'body', body, 'mid', ARGV[3], 'why', ARGV[4])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
return 1
"""
# KEYS: stream, requeued. ARGV: dead entry id, body. Requeue a dead letter once: a new entry (a new
# message: its own id, delivery 1), the dead entry marked with it in the same script.
_REQUEUE = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return false end
local id = redis.call('XADD', KEYS[1], '*', 'body', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], id)
return id
"""
# The fields a producer's entry may have: the body, and two the metrics and traces read as untrusted
# (validated there, never bookkeeping): when it was first sent, and its W3C trace context.
_ENTRY_FIELDS = frozenset({b"body", b"sent", b"traceparent"})
_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class RedisStreamsTransport(Transport):
    """``redis://host:port/db?stream=jobs&group=pandastack`` (``rediss://`` for TLS)."""

    def __init__(self, url: str, lease_seconds: float = 60.0, consumer: str | None = None) -> None:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.stream = query.pop("stream", "pandastack-jobs")
        self.group = query.pop("group", "pandastack")
        self.name = self.stream
        self.key_scope = f"db={(parts.path or '/0').strip('/') or '0'}"
        self.lease_seconds = lease_seconds
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._url = urlunsplit(parts._replace(query="&".join(f"{k}={v}" for k, v in query.items())))
        self.dead_stream, self.reply_stream = f"{self.stream}:dead", f"{self.stream}:results"
        self._delayed = f"{self.stream}:delayed"
        self._ids = f"{self.stream}:ids"
        self._requeued = f"{self.stream}:dead:requeued"
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
        self._readd = r.register_script(_READD)
        self._requeue = r.register_script(_REQUEUE)
        self._receive = r.register_script(_RECEIVE)
        self._dead = r.register_script(_DEAD)

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
        self._redis()
        lease_ms = int((self.lease_seconds or 60) * 1000)
        cap = -1 if self.max_body_bytes is None else self.max_body_bytes
        deadline = time.monotonic() + wait_seconds
        while True:
            self._call(self._promote, keys=[self.stream, self._delayed, self._ids], args=[time.time()])
            args = [self.group, self.consumer, lease_ms, max_messages, cap]
            got = self._call(self._receive, keys=[self.stream], args=args) or []
            if got or time.monotonic() >= deadline:
                return self._deliveries(got)
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def _deliveries(self, entries: list[list[Any]]) -> list[Delivery]:
        if not entries:
            return []
        books = self._call(self._redis().hmget, self._ids, [e[0] for e in entries])
        return [self._delivery(e, book) for e, book in zip(entries, books, strict=True)]

    def _delivery(self, entry: list[Any], book: bytes | None) -> Delivery:
        """One entry (``[id, flat fields, oversized, claimed]`` from the receive script) as a
        delivery; nothing in it can raise out of receive()."""
        eid, flat, over, claimed = entry
        entry_id = _text(eid)
        fields: dict[bytes, bytes] = {}
        try:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            times = 1
            if claimed:
                info = self._call(self._redis().xpending_range, self.stream, self.group, eid, eid, 1)
                times = int(info[0]["times_delivered"]) if info else 1
            mid, prior = entry_id, 0
            if book is not None:
                mid, prior = _book(book, entry_id)
            body = fields.get(b"body", b"")
            # Producer-written (the metrics and traces validate them): when it was first sent, its trace.
            extra = {
                "sent": fields.get(b"sent") or entry_id.split("-")[0],
                "traceparent": fields.get(b"traceparent"),
            }
            d = Delivery(mid, body, prior + times, handle=entry_id, extra=extra)
            unknown = sorted(set(fields) - _ENTRY_FIELDS)
            if unknown:
                name = unknown[0].decode("utf-8", "replace")[:64]
                problem = "is not a stream entry field a producer may set (body, sent, traceparent)"
                d.malformed = (name, problem)
            elif over:  # emptied by the receive script: never read
                name, size = _text(over[0])[:64], int(over[1])
                problem = f"is {size} bytes, over the {self.max_body_bytes}-byte limit (not read)"
                d.malformed = (name, problem)
            return d
        except BrokerUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - confined to this entry
            logger.warning("stream entry %s could not be read (%s); dead-lettering it", entry_id, exc)
            problem = f"could not be read: {type(exc).__name__}: {exc}"
            body = fields.get(b"body", b"")
            return Delivery(entry_id, body, 1, handle=entry_id, malformed=("entry", problem))

    def _settle(self, delivery: Delivery, *extra: tuple[str, Any]) -> None:
        """In one MULTI: the extra commands, then XACK and XDEL of the entry."""
        pipe = self._redis().pipeline(transaction=True)
        for name, args in extra:
            getattr(pipe, name)(*args)
        pipe.xack(self.stream, self.group, delivery.handle)
        pipe.xdel(self.stream, delivery.handle)
        pipe.hdel(self._ids, delivery.handle)
        self._call(pipe.execute)

    def ack(self, delivery: Delivery) -> None:
        self._settle(delivery)

    def release(self, delivery: Delivery, delay_seconds: float) -> None:
        sent, tp = _text(delivery.extra.get("sent")), _text(delivery.extra.get("traceparent"))
        try:
            text = delivery.body.decode()
        except UnicodeDecodeError:  # never ran (a job's body is UTF-8 JSON): back at once
            delay_seconds = 0
        if delay_seconds <= 0:
            args = [self.group, delivery.handle, delivery.body, delivery.message_id, delivery.count, sent, tp]
            self._call(self._readd, keys=[self.stream, self._ids], args=args)
            return
        member = json.dumps(
            {"body": text, "mid": delivery.message_id, "prior": delivery.count, "sent": sent, "tp": tp}
        )
        self._settle(delivery, ("zadd", (self._delayed, {member: time.time() + delay_seconds})))

    def dead_letter(self, delivery: Delivery, why: DeadLetter) -> None:
        """To ``<stream>:dead`` with the entry's own body, copied on Redis's side (see _DEAD)."""
        self._call(
            self._dead,
            keys=[self.stream, self.dead_stream, self._ids],
            args=[self.group, delivery.handle, delivery.message_id, why.to_json(), delivery.body],
        )

    def _dead_entries(self) -> Any:
        """(dead entry id, record) of every dead letter not yet requeued, oldest first."""
        r = self._redis()
        start = "-"
        while True:
            page = self._call(r.xrange, self.dead_stream, start, "+", count=200)
            if not page:
                return
            ids = [eid for eid, _ in page]
            done = self._call(r.hmget, self._requeued, ids)
            for (eid, fields), requeued in zip(page, done, strict=True):
                if requeued is None:
                    yield eid, self._record(eid, fields)
            start = "(" + _text(page[-1][0])

    @staticmethod
    def _record(eid: bytes, fields: dict[bytes, bytes]) -> DeadLetterRecord:
        at = int(_text(eid).split("-")[0]) / 1000
        return DeadLetterRecord.stored(
            _text(fields.get(b"mid")), fields.get(b"body", b""), fields.get(b"why"), at
        )

    def dead_letters(self, limit: int = 100) -> list[DeadLetterRecord]:
        """From ``<stream>:dead``, leaving out those marked in ``<stream>:dead:requeued``."""
        out: list[DeadLetterRecord] = []
        for _, rec in self._dead_entries():
            out.append(rec)
            if len(out) >= limit:
                break
        return out

    def _put_back(self, broker_id: str) -> str | None:
        """A new entry with the dead letter's body; the dead entry stays, marked requeued (its
        reason is the message's history) in ``<stream>:dead:requeued`` (dead entry id -> new id)."""
        for eid, rec in self._dead_entries():
            if rec.broker_id == broker_id:
                new = self._call(self._requeue, keys=[self.stream, self._requeued], args=[eid, rec.body])
                if new:
                    return _text(new)
        return None

    def extend(self, delivery: Delivery) -> None:
        # XCLAIM to ourselves resets the entry's idle time; JUSTID leaves its delivery count alone.
        r = self._redis()
        self._call(r.xclaim, self.stream, self.group, self.consumer, 0, [delivery.handle], justid=True)

    def reply(self, body: bytes) -> None:
        r = self._redis()
        self._call(r.xadd, self.reply_stream, {"body": body}, maxlen=1_000_000, approximate=True)

    def send(self, body: bytes, message_id: str | None = None) -> None:
        """XADD the body (the only field; ``message_id`` has no place on a stream entry: the
        entry id is the message's identity)."""
        self._call(self._redis().xadd, self.stream, {"body": body})

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


def _book(raw: bytes, entry_id: str) -> tuple[str, int]:
    """A ``<stream>:ids`` value: the message's first entry id and its earlier deliveries."""
    doc = json.loads(raw)
    mid, prior = doc.get("mid"), doc.get("prior")
    if not isinstance(mid, str) or not mid or not isinstance(prior, int) or not 0 <= prior < 1_000_000:
        raise ValueError(f"bookkeeping of {entry_id} is not {{mid, prior}}: {raw[:100]!r}")
    return mid, prior


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

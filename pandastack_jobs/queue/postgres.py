"""PostgreSQL: a table queue taken with ``FOR UPDATE SKIP LOCKED``, leased by a column.

A receive stamps each row with a fresh lease token and ``visible_at = now() +
lease``; ack, release, extend and dead-letter act only while the token is still
the row's, so a consumer whose lease ran out cannot settle a row someone else
now holds. Rows whose lease expired (a killed worker) are taken again, their
``deliveries`` counting up. Tables: ``<table>``, ``<table>_dead``, ``<table>_results``.

A message's identity is its row id (a ``bigserial``: a producer cannot choose it); the
``message_id`` column is the producer's and is never read as identity. ``deliveries``,
``visible_at`` and ``lease`` are the consumer's: grant producers ``INSERT (queue, body,
message_id)`` only (docs/queues.md); if one could write ``deliveries`` anyway, a receive clamps
it to ``0..1,000,000`` first, so it can neither overflow the column nor go negative.
"""

from __future__ import annotations

import re
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import psycopg
from psycopg import sql

from .transport import BrokerUnavailable, DeadLetter, DeadLetterRecord, Delivery, LeaseLost, Transport

_TABLE = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t} (
    id bigserial PRIMARY KEY,
    queue text NOT NULL,
    message_id text,
    body bytea NOT NULL,
    deliveries integer NOT NULL DEFAULT 0,
    visible_at timestamptz NOT NULL DEFAULT now(),
    lease uuid,
    enqueued_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS {ix} ON {t} (queue, visible_at, id);
CREATE TABLE IF NOT EXISTS {dead} (
    id bigserial PRIMARY KEY, queue text NOT NULL, message_id text NOT NULL, body bytea NOT NULL,
    why jsonb NOT NULL, dead_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE {dead} ADD COLUMN IF NOT EXISTS requeued_as text;
CREATE TABLE IF NOT EXISTS {results} (
    id bigserial PRIMARY KEY, queue text NOT NULL, body bytea NOT NULL, at timestamptz NOT NULL DEFAULT now()
);
"""


class PostgresTransport(Transport):
    """``postgresql://user@host:port/db?queue=jobs&table=pandastack_queue``."""

    def __init__(self, url: str, lease_seconds: float = 60.0) -> None:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.name = query.pop("queue", "pandastack-jobs")
        table = query.pop("table", "pandastack_queue")
        if not _TABLE.match(table):
            raise ValueError(f"table={table!r}: use a lower-case SQL name, e.g. pandastack_queue")
        self.lease_seconds = lease_seconds
        self._url = urlunsplit(parts._replace(query="&".join(f"{k}={v}" for k, v in query.items())))
        self._t = sql.Identifier(table)
        self._dead = sql.Identifier(f"{table}_dead")
        self._results = sql.Identifier(f"{table}_results")
        self._ix = sql.Identifier(f"{table}_ready")
        self._table = table
        self.key_scope = f"table={table}"
        self._conn: psycopg.Connection[Any] | None = None

    def connect(self) -> None:
        self.close()
        try:
            conn = psycopg.connect(self._url, autocommit=True, connect_timeout=10)
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (self._table,))
                conn.execute(
                    sql.SQL(_SCHEMA).format(t=self._t, ix=self._ix, dead=self._dead, results=self._results)
                )
        except psycopg.OperationalError as exc:
            raise BrokerUnavailable(f"PostgreSQL at {_safe(self._url)}: {_first_line(exc)}") from None
        self._conn = conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _exec(
        self, query: sql.Composed | str, params: tuple[Any, ...] = (), *, leased: bool = False
    ) -> list[tuple[Any, ...]]:
        """Run one statement; ``leased``: it must touch the delivery's row while the lease is ours."""
        if self._conn is None or self._conn.closed:
            raise BrokerUnavailable("PostgreSQL: not connected")
        try:
            cur = self._conn.execute(query, params)
            if leased and cur.rowcount == 0:
                raise LeaseLost("the row is gone or leased to another consumer")
            return cur.fetchall() if cur.description else []
        except psycopg.OperationalError as exc:
            self.close()
            raise BrokerUnavailable(f"PostgreSQL at {_safe(self._url)}: {_first_line(exc)}") from None

    def receive(self, max_messages: int, wait_seconds: float) -> list[Delivery]:
        # The rows are picked in a MATERIALIZED CTE, run exactly once. As ``WHERE id IN (SELECT
        # ... LIMIT n FOR UPDATE SKIP LOCKED)`` the planner may make the subquery the inner side of
        # a nested loop and run it again for every outer row; each run skips the rows the last one
        # took, so one receive took every ready row past the LIMIT, and the other consumers none.
        query = sql.SQL(
            "WITH picked AS MATERIALIZED (SELECT id FROM {t} WHERE queue = %s AND visible_at <= now()"
            "  ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)"
            " UPDATE {t} SET deliveries = least(greatest({t}.deliveries, 0), 1000000) + 1,"
            " lease = gen_random_uuid(), visible_at = now() + make_interval(secs => %s)"
            " FROM picked WHERE {t}.id = picked.id"
            " RETURNING {t}.id, {t}.id::text,"
            " CASE WHEN %s::bigint IS NULL OR octet_length({t}.body) <= %s::bigint THEN {t}.body END,"
            " {t}.deliveries, {t}.lease, extract(epoch from {t}.enqueued_at), octet_length({t}.body)"
        ).format(t=self._t)
        cap = self.max_body_bytes
        deadline = time.monotonic() + wait_seconds
        while True:
            # UPDATE ... RETURNING does not keep the subquery's order: put the oldest first again
            # (a chunk is filled in arrival order).
            rows = sorted(
                self._exec(query, (self.name, max_messages, self.lease_seconds, cap, cap)),
                key=lambda r: r[0],
            )
            if rows or time.monotonic() >= deadline:
                return [_delivery(row, cap) for row in rows]
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))

    def ack(self, delivery: Delivery) -> None:
        self._exec(
            sql.SQL("DELETE FROM {t} WHERE id = %s AND lease = %s").format(t=self._t),
            delivery.handle,
            leased=True,
        )

    def release(self, delivery: Delivery, delay_seconds: float) -> None:
        query = sql.SQL(
            "UPDATE {t} SET lease = NULL, visible_at = now() + make_interval(secs => %s)"
            " WHERE id = %s AND lease = %s"
        ).format(t=self._t)
        self._exec(query, (delay_seconds, *delivery.handle), leased=True)

    def dead_letter(self, delivery: Delivery, why: DeadLetter) -> None:
        query = sql.SQL(
            "WITH gone AS (DELETE FROM {t} WHERE id = %s AND lease = %s RETURNING queue, body)"
            " INSERT INTO {dead} (queue, message_id, body, why) SELECT queue, %s, body, %s::jsonb FROM gone"
        ).format(t=self._t, dead=self._dead)
        self._exec(query, (*delivery.handle, delivery.message_id, why.to_json()), leased=True)

    def dead_letters(self, limit: int = 100) -> list[DeadLetterRecord]:
        """From ``<table>_dead``, leaving out the rows marked ``requeued_as``."""
        query = sql.SQL(
            "SELECT message_id, body, why, extract(epoch from dead_at) FROM {dead}"
            " WHERE queue = %s AND requeued_as IS NULL ORDER BY id LIMIT %s"
        ).format(dead=self._dead)
        rows = self._exec(query, (self.name, limit))
        return [DeadLetterRecord.stored(mid, bytes(body), why, float(at)) for mid, body, why, at in rows]

    def _put_back(self, broker_id: str) -> str | None:
        """In one statement: a new row with the dead letter's body (a new id, delivery 1), and the
        dead row kept, marked ``requeued_as`` the new id (its reason is the message's history)."""
        query = sql.SQL(
            "WITH d AS (SELECT id, body FROM {dead} WHERE queue = %s AND message_id = %s"
            "   AND requeued_as IS NULL ORDER BY id LIMIT 1 FOR UPDATE),"
            " ins AS (INSERT INTO {t} (queue, body) SELECT %s, body FROM d RETURNING id),"
            " upd AS (UPDATE {dead} SET requeued_as = (SELECT id::text FROM ins)"
            "   WHERE id = (SELECT id FROM d) RETURNING 1)"
            " SELECT id::text FROM ins"
        ).format(dead=self._dead, t=self._t)
        rows = self._exec(query, (self.name, broker_id, self.name))
        return str(rows[0][0]) if rows else None

    def extend(self, delivery: Delivery) -> None:
        query = sql.SQL(
            "UPDATE {t} SET visible_at = now() + make_interval(secs => %s) WHERE id = %s AND lease = %s"
        ).format(t=self._t)
        self._exec(query, (self.lease_seconds, *delivery.handle), leased=True)

    def reply(self, body: bytes) -> None:
        self._exec(
            sql.SQL("INSERT INTO {r} (queue, body) VALUES (%s, %s)").format(r=self._results),
            (self.name, body),
        )

    def send(self, body: bytes, message_id: str | None = None) -> None:
        """INSERT the message (``message_id`` goes to its column, the producer's: never identity)."""
        query = sql.SQL("INSERT INTO {t} (queue, message_id, body) VALUES (%s, %s, %s)").format(t=self._t)
        self._exec(query, (self.name, message_id, body))

    def backlog(self) -> dict[str, int] | None:
        """One count over the queue's rows: ready, leased, or released with a delay."""
        query = sql.SQL(
            "SELECT count(*) FILTER (WHERE visible_at <= now()),"
            " count(*) FILTER (WHERE visible_at > now() AND lease IS NOT NULL),"
            " count(*) FILTER (WHERE visible_at > now() AND lease IS NULL) FROM {t} WHERE queue = %s"
        ).format(t=self._t)
        ready, leased, delayed = self._exec(query, (self.name,))[0]
        return {"ready": int(ready), "leased": int(leased), "delayed": int(delayed)}


def _delivery(row: tuple[Any, ...], cap: int | None) -> Delivery:
    """A received row; a body over ``cap`` was left in the table (the dead letter copies it there)."""
    rid, mid, body, n, lease, at, size = row
    d = Delivery(mid, b"" if body is None else bytes(body), n, handle=(rid, lease), extra={"sent": float(at)})
    if body is None:
        d.malformed = ("body", f"is {size} bytes, over the {cap}-byte limit (not read)")
    return d


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _safe(url: str) -> str:
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}{parts.hostname or ''}{port}", query=""))

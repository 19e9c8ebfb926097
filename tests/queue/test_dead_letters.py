"""``pandastack-jobs dead-letters`` (issue 36): a dead letter the consumer wrote is listed with both
ids (the message's ``id`` and the broker's) and its reason; ``--requeue`` puts it back as a new
message that runs as delivery 1 and is acked, and the dead letter is no longer listed (the store
keeps it, marked requeued); an unknown id exits 2. Real brokers, the real CLI, a real local server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from e2e.brokers import AWS_ENV, Broker
from tests.queue.conftest import REPO, Running, echo_job, message

IMPLEMENTED = ["redis", "postgres", "sqs", "rabbitmq", "kafka"]
KEPT = {"redis", "postgres", "kafka"}  # the dead letter stays in the store, marked requeued


def _cli(broker: Broker, queue: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **AWS_ENV, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "pandastack_jobs.queue.cli", "dead-letters", "--broker", broker.url(queue)]
    return subprocess.run([*argv, *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("broker", IMPLEMENTED, indirect=True)
def test_a_dead_letter_is_listed_with_both_ids_and_requeued_as_delivery_1(
    broker: Broker, queue: str, start_consumer: Callable[..., Running]
) -> None:
    producer = broker.transport(queue)
    body = message(echo_job(), id="order-7")
    producer.send(body + b" " * 600)  # over the first consumer's limit: dead-lettered, kind malformed
    producer.close()
    stats = start_consumer(until=lambda s: s.dead_lettered >= 1, max_message_bytes=512).join(60)
    assert stats.dead_lettered == 1 and stats.acked == 0

    listed = _cli(broker, queue, "--json")
    assert listed.returncode == 0, listed.stderr
    rows: list[dict[str, Any]] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert len(rows) == 1, listed.stdout
    dead = rows[0]
    assert dead["id"] == "order-7" and dead["broker_id"], dead  # read from the stored body
    assert dead["kind"] == "malformed" and "512" in dead["reason"], dead
    plain = _cli(broker, queue)
    assert f"broker_id={dead['broker_id']} id=order-7 kind=malformed" in plain.stdout, plain.stdout
    if broker.name in KEPT:
        # The stored dead letter itself names both ids (whatever else the broker keeps beside it);
        # reading it back on SQS and RabbitMQ takes it off the queue, so there it is checked below.
        stored = broker.dead(queue)
        # PostgreSQL and Redis never read a body over the limit into the consumer (the broker
        # copies it to the dead letter), so the consumer's stored reason cannot name its id.
        want_id = None if broker.name in ("postgres", "redis") else "order-7"
        assert stored[0]["why"]["id"] == want_id and stored[0]["why"]["broker_id"] == dead["broker_id"]

    unknown = _cli(broker, queue, "--requeue", "no-such-id")
    assert unknown.returncode == 2, unknown.stderr
    assert "no-such-id" in unknown.stderr and "Traceback" not in unknown.stderr, unknown.stderr

    requeued = _cli(broker, queue, "--requeue", dead["broker_id"])
    assert requeued.returncode == 0, requeued.stderr
    assert f"requeued {dead['broker_id']}" in requeued.stdout, requeued.stdout
    again = _cli(broker, queue, "--json")
    assert again.returncode == 0 and again.stdout.strip() == "", again.stdout + again.stderr
    twice = _cli(broker, queue, "--requeue", dead["broker_id"])
    assert twice.returncode == 2, twice.stdout + twice.stderr  # requeued once, not twice

    stats = start_consumer(until=lambda s: s.acked >= 1).join(60)
    assert stats.acked == 1 and stats.dead_lettered == 0 and stats.redelivered == 0
    results = broker.results(queue)
    assert [r["delivery"] for r in results] == [1], results
    assert broker.depth(queue) == 0
    if broker.name not in KEPT:  # the requeued dead letter is gone; a second one names both ids
        producer = broker.transport(queue)
        producer.send(message(echo_job(), id="order-8") + b" " * 600)
        producer.close()
        start_consumer(until=lambda s: s.dead_lettered >= 1, max_message_bytes=512).join(60)
        (stored,) = broker.dead(queue)
        assert stored["why"]["id"] == "order-8" and stored["why"]["broker_id"], stored


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_stored_reason_of_any_shape_is_listed_never_a_traceback(broker: Broker, queue: str) -> None:
    """Whoever can write the dead-letter store (a producer with the broker's write access, an old
    consumer) can store any ``why``: nested past the parser, not JSON, not an object. Each is
    listed, kind ``unknown``, and the CLI exits 0. Seen failing before the transports shared
    ``DeadLetterRecord.stored`` (each parsed its store itself, catching ValueError only): the
    nested one raised RecursionError out of ``dead-letters`` (a traceback, exit 1)."""
    r = broker.r  # type: ignore[attr-defined]
    for mid, why in (("deep", b"[" * 100_000), ("text", b"not json"), ("list", b"[1, 2]")):
        r.xadd(f"{queue}:dead", {"body": b'{"id": "x"}', "mid": mid, "why": why})
    listed = _cli(broker, queue, "--json")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(d["broker_id"], d["kind"], d["id"]) for d in rows] == [
        ("deep", "unknown", "x"),
        ("text", "unknown", "x"),
        ("list", "unknown", "x"),
    ], rows


@pytest.mark.parametrize("broker", ["rabbitmq", "postgres"], indirect=True)
def test_hostile_field_names_are_dead_lettered_once_and_stop_nobody(
    broker: Broker, queue: str, start_consumer: Callable[..., Running]
) -> None:
    """Red team, session 11: a 450 KB unknown field name made RabbitMQ close the connection over
    the dead letter's header (every other message was redelivered until dead-lettered), and a NUL
    in one could never be stored in PostgreSQL's jsonb (a failed dead letter once per lease, for
    ever). Both are dead-lettered once, bounded and on one line; the victims are answered."""
    producer = broker.transport(queue)
    producer.send(json.dumps({"id": "evil-long", "command": "true", "f" * 450_000: 1}).encode())
    producer.send(json.dumps({"id": "evil-nul", "command": "true", "\u0000\nWARNING forged": 1}).encode())
    for i in range(3):
        producer.send(message(echo_job(), id=f"victim-{i}"))
    producer.close()
    stats = start_consumer(until=lambda s: s.acked + s.dead_lettered >= 5, concurrency=2).join(90)
    assert (stats.acked, stats.dead_lettered, stats.reconnects, stats.redelivered) == (3, 2, 0, 0), stats
    assert sorted(r["result"]["id"] for r in broker.results(queue)) == ["victim-0", "victim-1", "victim-2"]
    listed = _cli(broker, queue, "--json")  # the stored reasons, read back through the CLI
    assert listed.returncode == 0, listed.stderr
    rows = {row["id"]: row for row in map(json.loads, listed.stdout.splitlines())}
    assert set(rows) == {"evil-long", "evil-nul"}, listed.stdout
    assert rows["evil-long"]["kind"] == "malformed" and len(rows["evil-long"]["field"]) <= 120
    assert rows["evil-nul"]["field"] == "\\x00\\nWARNING forged", rows["evil-nul"]

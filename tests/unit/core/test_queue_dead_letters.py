"""The in-memory transport's dead letters (issue 36), as the real brokers' are in
tests/queue/test_dead_letters.py: listed with both ids, requeued once as a new message that
runs as delivery 1; a transport without them says which it is."""

from __future__ import annotations

import json

import pytest

from pandastack_jobs.queue.memory import MemoryTransport
from pandastack_jobs.queue.transport import DeadLetterRecord, DeadLettersUnsupported, UnknownDeadLetter
from pandastack_jobs.testing import FakeClient
from pandastack_local.testing.waiting import wait_for
from tests.unit.core.test_queue_outage import _start, _stop


def test_a_dead_letter_is_listed_with_both_ids_and_requeued_as_delivery_1(fake: FakeClient) -> None:
    t = MemoryTransport()
    fake.script("echo", result={"fine": True})
    t.send(json.dumps({"id": "order-7", "command": "echo hi"}).encode() + b" " * 600)
    c, thread = _start(fake, t, max_message_bytes=512)
    try:
        wait_for("the dead letter", lambda: t.dead, timeout=10, interval=0.01)
    finally:
        _stop(c, thread)
    (dead,) = t.dead_letters()
    assert (dead.broker_id, dead.id, dead.kind) == ("m0", "order-7", "malformed")
    assert t.dead[0][1].id == "order-7" and t.dead[0][1].broker_id == "m0"  # the stored one names both

    # One message for every transport (the base class raises it): the queue, the id, how to list.
    with pytest.raises(UnknownDeadLetter, match=r"queue 'mem' has broker id 'no-such-id'.*dead-letters"):
        t.requeue("no-such-id")
    new = t.requeue("m0")
    assert new != "m0" and t.dead_letters() == []
    with pytest.raises(UnknownDeadLetter):
        t.requeue("m0")  # once only
    c, thread = _start(fake, t)
    try:
        wait_for("the ack", lambda: t.acked, timeout=10, interval=0.01)
    finally:
        _stop(c, thread)
    assert t.acked == [new] and t.counts[new] == 1


def test_a_transport_without_dead_letters_names_itself() -> None:
    from pandastack_jobs.queue.transport import Transport

    class Bare(MemoryTransport):
        dead_letters = Transport.dead_letters  # type: ignore[assignment]

    with pytest.raises(DeadLettersUnsupported, match="Bare"):
        Bare().dead_letters()


@pytest.mark.parametrize(
    "why",
    [
        b"[" * 100_000,  # nested past the parser: RecursionError
        "not json",
        b"\xff\xfe",  # not UTF-8
        "[1, 2]",  # JSON, not an object
        7,  # an AMQP header of another type
        None,
    ],
)
def test_a_stored_reason_of_any_shape_reads_as_unknown(why: object) -> None:
    """Every transport reads its store through ``DeadLetterRecord.stored``; whatever the store
    holds, it is a record (kind ``unknown``, the id from the body), never an exception."""
    rec = DeadLetterRecord.stored("b-1", b'{"id": "order-7"}', why, None)  # type: ignore[arg-type]
    assert (rec.broker_id, rec.id, rec.kind, rec.deliveries) == ("b-1", "order-7", "unknown", 0)


@pytest.mark.parametrize("as_stored", [json.dumps, lambda d: json.dumps(d).encode(), lambda d: d])
def test_a_stored_reason_is_read_from_its_json_or_its_dict(as_stored: object) -> None:
    why = {"kind": "timeout", "reason": "ran 30 s", "deliveries": 3, "id": "o-1", "broker_id": "b-9"}
    rec = DeadLetterRecord.stored("b-1", b"{}", as_stored(why), 12.5)  # type: ignore[operator]
    assert (rec.broker_id, rec.id, rec.kind, rec.reason, rec.deliveries, rec.at) == (
        "b-9",
        "o-1",
        "timeout",
        "ran 30 s",
        3,
        12.5,
    )

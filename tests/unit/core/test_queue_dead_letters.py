"""The in-memory transport's dead letters (issue 36), as the real brokers' are in
tests/queue/test_dead_letters.py: listed with both ids, requeued once as a new message that
runs as delivery 1; a transport without them says which it is."""

from __future__ import annotations

import json

import pytest

from pandastack_jobs.queue.memory import MemoryTransport
from pandastack_jobs.queue.message import MessageError
from pandastack_jobs.queue.transport import (
    MAX_DEAD_LETTER_BYTES,
    DeadLetter,
    DeadLetterRecord,
    DeadLettersUnsupported,
    UnknownDeadLetter,
)
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


# A hostile producer's text in a dead letter (red team, session 11): a 450 KB unknown field name made
# RabbitMQ's `x-pandastack-dead` header too large for one frame (the broker closed the connection
# and every tenant's messages were dead-lettered); a NUL could never be stored by PostgreSQL's jsonb
# (a loop, once per lease); a newline in a field name forged a log line.
def test_a_dead_letter_of_hostile_text_is_bounded_single_line_and_nul_free() -> None:
    huge = "\nWARNING forged: dead-lettered: id=victim" + "x" * 450_000 + "\x00"
    why = DeadLetter(
        reason=f"{huge}: is not a message field" * 3,
        kind="malformed\x00",
        field=huge,
        deliveries=1,
        stdout_tail="\x00" * 100_000,
        stderr_tail="\ud800" * 100_000,
        id=huge,
        broker_id=huge,
    )
    text = why.to_json()
    assert len(text.encode()) <= MAX_DEAD_LETTER_BYTES, len(text)
    assert "\\u0000" not in text and "\\ud800" not in text
    stored = json.loads(text)
    assert stored["field"].startswith("\\nWARNING forged") and "\n" not in stored["field"]
    assert len(stored["field"]) <= 120 and len(stored["id"]) <= 256 and len(stored["broker_id"]) <= 256
    assert stored["kind"] == "malformed\\x00" and stored["deliveries"] == 1
    # The reason keeps its lines (a traceback), bounded; the tails keep their ends.
    assert len(stored["reason"]) <= 4000 and stored["reason"].endswith("…")
    assert len(stored["stdout_tail"]) <= 2000 and len(stored["stderr_tail"]) <= 2000


def test_ordinary_dead_letter_text_is_kept_as_it_is() -> None:
    why = DeadLetter(
        "job failed with exit code 1:\nTraceback ...", "exit_code", "comand", 2, "out", "err", "o-7", "m1"
    )
    assert json.loads(why.to_json()) == why.as_dict()
    assert why.field == "comand" and why.reason.startswith("job failed with exit code 1:\nTraceback")


def test_a_message_error_names_a_hostile_field_printably_and_briefly() -> None:
    exc = MessageError("\nWARNING forged" + "y" * 10_000, "is not a message field")
    assert "\n" not in exc.field and len(exc.field) <= 120
    assert len(str(exc)) < 300

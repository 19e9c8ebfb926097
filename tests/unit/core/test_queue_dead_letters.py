"""The in-memory transport's dead letters (issue 36), as the real brokers' are in
tests/queue/test_dead_letters.py: listed with both ids, requeued once as a new message that
runs as delivery 1; a transport without them says which it is."""

from __future__ import annotations

import json

import pytest

from pandastack_jobs.queue.memory import MemoryTransport
from pandastack_jobs.queue.transport import DeadLettersUnsupported, UnknownDeadLetter
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

    with pytest.raises(UnknownDeadLetter, match="no-such-id"):
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

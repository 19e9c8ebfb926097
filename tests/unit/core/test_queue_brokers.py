"""The broker registry: one table from URL scheme to transport class, third-party entries welcome."""

from __future__ import annotations

import pytest

from pandastack_jobs.queue import BROKERS, SCHEMES, open_transport, transport_class
from pandastack_jobs.queue.memory import MemoryTransport


def test_every_scheme_opens_from_the_one_table() -> None:
    assert SCHEMES == tuple(BROKERS)
    for scheme in ("redis", "postgresql", "amqp", "sqs", "kafka", "memory"):
        assert scheme in BROKERS
    t = open_transport("memory://jobs")
    assert isinstance(t, MemoryTransport) and t.name == "jobs"


def test_an_unknown_scheme_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"scheme 'nats' is not one of redis, .*kafka, memory"):
        open_transport("nats://localhost/jobs")


def test_a_third_party_transport_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BROKERS, "mine", "pandastack_jobs.queue.memory:MemoryTransport")
    assert isinstance(open_transport("mine://q"), MemoryTransport)
    monkeypatch.setitem(BROKERS, "bad", "pandastack_jobs.queue.memory:Delivery")
    with pytest.raises(ValueError, match=r"BROKERS\['bad'\] .* does not name a Transport class"):
        transport_class("bad")


def test_a_memory_message_is_delivered_again_after_its_release_delay() -> None:
    t = open_transport("memory://q")
    t.send(b"{}", "a")
    (d,) = t.receive(10, 0)
    t.release(d, 0.2)
    assert t.receive(10, 0) == []
    (again,) = t.receive(10, 2)
    assert again.message_id == "a" and again.count == 2

"""The Kafka transport's offset bookkeeping, without a broker: what it commits while messages of
one partition finish out of order (tests/queue/test_kafka.py holds it on Apache Kafka)."""

from __future__ import annotations

import json

from pandastack_jobs.queue.kafka import _META_BYTES, _Part, _tenant


def test_the_commit_point_is_the_lowest_unsettled_offset_and_settled_ones_past_it_are_listed() -> None:
    part = _Part(epoch=1, committed=-1, high=0)
    for offset in range(5):
        part.open.add(offset)
        part.high = offset + 1
    assert part.commit_point() == 0
    for done in (1, 2, 4):  # finished out of order; 0 and 3 still run
        part.open.discard(done)
    assert part.commit_point() == 0
    assert part.settled_ranges() == [[1, 3], [4, 5]]
    part.open.discard(0)
    assert part.commit_point() == 3 and part.settled_ranges() == [[4, 5]]
    part.open.discard(3)
    assert part.commit_point() == 5 and part.settled_ranges() == []


def test_the_metadata_carries_the_starts_and_settled_ranges_and_stays_under_the_brokers_limit() -> None:
    part = _Part(epoch=1, committed=0, high=3, open={0, 2}, starts={0: 2, 2: 1})
    assert json.loads(part.metadata()) == {"starts": {"0": 2, "2": 1}, "settled": [[1, 2]]}
    many = _Part(epoch=1, committed=0, high=4000, open=set(range(0, 4000, 2)))
    many.starts = {o: 1 for o in many.open}
    text = many.metadata()
    assert len(text) <= _META_BYTES
    doc = json.loads(text)
    assert doc["settled"] == [] and doc["starts"]  # settled ranges give way first: a rerun, never a skip


def test_a_previous_owners_settled_ranges_are_skipped() -> None:
    part = _Part(epoch=2, committed=0, high=0, settled=[(1, 3)])
    assert [o for o in range(5) if part.was_settled(o)] == [1, 2]


def test_the_default_key_is_the_messages_tenant() -> None:
    assert _tenant(b'{"tenant": "acme", "command": "x"}') == "acme"
    for body in (b'{"command": "x"}', b'{"tenant": 5}', b'{"tenant": ""}', b"[1]", b"not json"):
        assert _tenant(body) is None

"""The batch that the Airflow operator's and the Prefect flow's queue tests both consume.

One good message, one that fails its first delivery, one whose exit code is permanent: consumed
with ``CONSUME``, the good and the flaky one end with ``RESULTS`` and the poison one is
dead-lettered.
"""

from __future__ import annotations

import json
from typing import Any

from e2e.brokers import Broker
from tests.queue.conftest import DEFAULTS, echo_job, message

CONSUME: dict[str, Any] = {
    "concurrency": 2,
    "max_messages": 10,
    "idle_seconds": 2,
    "lease_seconds": 5,
    "release_delay": 0.2,
    "defaults": DEFAULTS,
}
RESULTS = {"good": {"id": "good", "delivery": 1}, "flaky": {"id": "flaky", "delivery": 2}}


def send_batch(broker: Broker, queue: str, *extra: bytes) -> None:
    """The good, flaky and poison messages, then any ``extra`` bodies."""
    t = broker.transport(queue)
    t.send(message(echo_job(), id="good"))
    t.send(message(f'[ "$QUEUE_DELIVERY" -ge 2 ] || exit 1; {echo_job()}', id="flaky"))
    t.send(message("exit 4", id="poison", permanent_exit_codes=[4]))
    for body in extra:
        t.send(body)
    t.close()


def results(broker: Broker, queue: str) -> dict[str, Any]:
    """``{message id: its result}`` of what the broker's result store holds."""
    return {r["id"]: r["result"] for r in broker.results(queue)}


# The chunk batch: the isolation key is ``input.customer``; n0 and n1 have none (keyless).
CHUNK_CONSUME: dict[str, Any] = {
    **CONSUME,
    "concurrency": 1,
    "chunk_size": 4,
    "chunk_key": "input.customer",
    "chunk_keyless": True,
}
CHUNK_IDS = ["a0", "a1", "a2", "g0", "n0", "n1"]


def _chunk_message(mid: str, customer: str | None, pre: str = "") -> bytes:
    doc: dict[str, Any] = {"id": mid, "command": pre + echo_job()}
    doc["input"] = {"customer": customer} if customer else {}
    return json.dumps(doc).encode()


def send_chunk_batch(broker: Broker, queue: str) -> None:
    """Three messages of customer acme (a1 fails its first delivery, a2 takes 0.5 s), one of
    globex, two without a customer."""
    t = broker.transport(queue)
    t.send(_chunk_message("a0", "acme"))
    t.send(_chunk_message("a1", "acme", '[ "$QUEUE_DELIVERY" -ge 2 ] || exit 1; '))
    t.send(_chunk_message("a2", "acme", "sleep 0.5; "))
    t.send(_chunk_message("g0", "globex"))
    t.send(_chunk_message("n0", None))
    t.send(_chunk_message("n1", None))
    t.close()


def check_chunk_results(broker: Broker, queue: str) -> dict[str, dict[str, Any]]:
    """Each message acked once with its own result; a0 and a2 shared a sandbox, a1 came back alone,
    globex alone, the two keyless ones together (``chunk_keyless``). Returns the replies by id."""
    replies = broker.results(queue)
    assert sorted(r["id"] for r in replies) == CHUNK_IDS, replies
    by_id = {r["id"]: r for r in replies}
    for mid, r in by_id.items():
        assert r["result"] == {"id": mid, "delivery": 2 if mid == "a1" else 1}, r
    sandbox = {mid: r["sandbox_id"] for mid, r in by_id.items()}
    assert sandbox["a0"] == sandbox["a2"] and sandbox["n0"] == sandbox["n1"], sandbox
    assert len({sandbox[m] for m in ("a0", "a1", "g0", "n0")}) == 4, sandbox
    assert broker.dead(queue) == [] and broker.depth(queue) == 0
    return by_id

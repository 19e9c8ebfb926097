"""The batch that the Airflow operator's and the Prefect flow's queue tests both consume.

One good message, one that fails its first delivery, one whose exit code is permanent: consumed
with ``CONSUME``, the good and the flaky one end with ``RESULTS`` and the poison one is
dead-lettered.
"""

from __future__ import annotations

from typing import Any

from tests.queue.brokers import Broker
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

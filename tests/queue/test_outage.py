"""An outage of the PandaStack API is never charged to a message (issue 33): on every real broker,
the local server is killed for 30 s while messages wait and arrive; the consumer pauses pulling,
says so, probes, resumes, and afterwards every message is acked exactly once, none dead-lettered,
none lost."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from e2e.brokers import Broker
from pandastack_jobs import ConnectionConfig
from pandastack_jobs.queue import Consumer
from pandastack_local import LocalServer
from pandastack_local.testing.waiting import wait_for
from tests.queue.conftest import DEFAULTS, LEASE, Running, echo_job, message
from tests.support.server import write_template

pytestmark = pytest.mark.timeout(240)

# The outage length. The behaviour under test does not depend on it (the backoff is
# capped well below it), but a shorter outage would not show that several probes fail in turn.
OUTAGE_SECONDS = 30.0


def test_a_platform_outage_is_never_charged_to_a_message(
    broker: Broker,
    queue: str,
    make_local_server: Callable[..., LocalServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pandastack_jobs")
    server = make_local_server()
    t = broker.transport(queue)
    conn = ConnectionConfig(api_url=server.url, api_key=server.api_key)
    # max_deliveries=2 and a 0.2 s release delay: a consumer that charged the outage to the
    # messages would dead-letter every one of them within a second of the server going away.
    consumer = Consumer(
        broker.transport(queue, LEASE),
        conn,
        defaults=DEFAULTS,
        concurrency=2,
        max_deliveries=2,
        release_delay=0.2,
        poll_seconds=0.3,
    )
    want = {"before", "mid-0", "mid-1", *(f"wait-{i}" for i in range(3)), *(f"late-{i}" for i in range(3))}
    running = Running(consumer, None)
    try:
        t.send(message(echo_job(), id="before"))
        wait_for("the first ack", lambda: consumer.stats.acked, timeout=60, check=lambda n: n >= 1)
        # Two jobs running when the server dies: their sandboxes die with it.
        t.send(message(echo_job(8), id="mid-0"))
        t.send(message(echo_job(8), id="mid-1"))
        wait_for(
            "two running sandboxes",
            lambda: len(server.client().sandboxes.list()),
            timeout=60,
            interval=0.1,
            check=lambda n: n == 2,
        )
        server.kill()
        down_at = time.monotonic()
        for i in range(3):  # waiting in the queue while the server is down
            t.send(message(echo_job(), id=f"wait-{i}"))
        wait_for(
            "the consumer to pause pulling",
            lambda: consumer.stats.api_down_since,
            timeout=20,
            interval=0.1,
        )
        line = consumer.stats.line()
        assert "PandaStack unreachable since" in line and "pulling paused" in line, line
        received_paused = consumer.stats.received
        # More arrive during the outage; a paused consumer does not pull them.
        time.sleep(max(0.0, down_at + OUTAGE_SECONDS / 2 - time.monotonic()))
        for i in range(3):
            t.send(message(echo_job(), id=f"late-{i}"))
        time.sleep(max(0.0, down_at + OUTAGE_SECONDS - time.monotonic()))
        assert consumer.stats.dead_lettered == 0 and broker.dead(queue) == []
        assert consumer.stats.received == received_paused, "pulled while paused"
        assert consumer.stats.api_down_since is not None  # still down: the probes failed
        server.start()  # same port, same key
        wait_for(
            "every message acked",
            lambda: consumer.stats.acked,
            timeout=90,
            interval=0.2,
            check=lambda n: n >= len(want),
        )
        assert consumer.stats.api_down_since is None
        assert "PandaStack unreachable" not in consumer.stats.line()
    finally:
        consumer.stop()
        stats = running.join(60)
    results = broker.results(queue)
    by_id = Counter(r["id"] for r in results if r.get("ok"))
    assert set(by_id) == want and all(n == 1 for n in by_id.values()), by_id  # each acked once
    assert stats.acked == len(want) and stats.dead_lettered == 0, stats
    assert broker.dead(queue) == [] and broker.depth(queue) == 0
    logged = caplog.text
    assert "PandaStack unreachable since" in logged and "pulling paused" in logged, logged[-4000:]
    assert "pulling resumed" in logged, logged[-4000:]
    assert server.api_key not in logged
    assert server.client().sandboxes.list() == []


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_template_that_never_fits_is_dead_lettered_and_pauses_no_one(
    broker: Broker,
    queue: str,
    make_local_server: Callable[..., LocalServer],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Red team (issue 33): a message naming a template over the server's whole memory budget
    (``--admission limits``: base's 2048 MB in 1500) was refused 507 on every delivery, taken
    for the platform being out of capacity: uncharged, and each refusal paused pulling for every
    tenant. The server now answers 400 naming ``memory_mb``: the message is dead-lettered at
    once (``bad_request``), never retried, and the other tenants' messages run with no pause.
    Seen failing before: no dead letter within 30 s, pulling paused."""
    caplog.set_level(logging.INFO, logger="pandastack_jobs")
    small = write_template(tmp_path / "small", name="small", cpu=1, memory_mb=256, disk_mb=16)
    server = make_local_server(
        template_dirs=[str(small)], pool_size=0, admission="limits", memory_budget_mb=1500
    )
    t = broker.transport(queue)
    t.send(message(echo_job(), id="greedy", template="base"))
    others = [f"other-{i}" for i in range(3)]
    for i in others:
        t.send(message(echo_job(), id=i))
    consumer = Consumer(
        broker.transport(queue, LEASE),
        ConnectionConfig(api_url=server.url, api_key=server.api_key, max_create_retry_seconds=20),
        defaults={**DEFAULTS, "template": "small"},
        concurrency=2,
        max_deliveries=3,
        release_delay=0.2,
        poll_seconds=0.3,
    )
    running = Running(consumer, lambda s: s.acked >= len(others) and s.dead_lettered >= 1)
    stats = running.join(30)
    (dead,) = broker.dead(queue)
    assert dead["why"]["kind"] == "bad_request" and dead["why"]["deliveries"] == 1, dead["why"]
    assert "memory_mb 2048" in dead["why"]["reason"] and "--memory-budget-mb" in dead["why"]["reason"]
    assert sorted(r["id"] for r in broker.results(queue)) == others
    assert stats.uncharged == 0 and stats.acked == len(others), stats
    assert "pulling paused" not in caplog.text, caplog.text[-4000:]
    assert broker.depth(queue) == 0

"""Issue 38 on every broker: ``Transport.backlog()`` reads the waiting messages in one call, the
enqueue time comes back with a delivery (for the end-to-end latency), and ``send_traced`` carries
the producer's ``traceparent`` where the broker has a place for it (Redis, RabbitMQ, SQS, Kafka) and
through a release."""

from __future__ import annotations

import time

from e2e.brokers import Broker
from pandastack_jobs.queue.metrics import sent_at
from pandastack_jobs.tracing import valid_traceparent

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CARRIES_TRACE = {"redis", "rabbitmq", "sqs", "kafka"}
HAS_SENT_TIME = {"redis", "postgres", "rabbitmq", "sqs", "kafka"}


def receive_one(t, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = t.receive(1, 1.0)
        if got:
            return got[0]
    raise AssertionError("no delivery")


def test_backlog_enqueue_time_and_trace_context(broker: Broker, queue: str) -> None:
    t = broker.transport(queue, 30)
    try:
        t.send_traced(b'{"command": "true"}', TP)
        t.send(b'{"command": "true 2"}')
        backlog = None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # SQS's counts are approximate and settle
            backlog = t.backlog()
            if backlog is not None and backlog.get("ready", 0) >= 2:
                break
            time.sleep(0.2)
        assert backlog is not None and backlog["ready"] >= 2, backlog
        started = time.time()
        d = receive_one(t)
        while d.body != b'{"command": "true"}':  # Kafka: the other partition's record may come first
            t.ack(d)
            d = receive_one(t)
        if broker.name in HAS_SENT_TIME:
            sent = sent_at(d)
            assert sent is not None and started - 30 <= sent <= time.time() + 2, d.extra
        if broker.name in CARRIES_TRACE:
            assert valid_traceparent(d.extra.get("traceparent")) == TP, d.extra
            # A release keeps it: the next delivery still links to the producer.
            t.release(d, 0)
            again = receive_one(t)
            while again.message_id != d.message_id:
                t.ack(again)
                again = receive_one(t)
            assert valid_traceparent(again.extra.get("traceparent")) == TP, again.extra
            assert again.count == 2
            if broker.name == "kafka":
                # The retry record carries the first send's time, and once all is settled the
                # groups' lag (end offsets minus committed ones) is nothing, on both topics.
                assert sent_at(again) == sent, again.extra
                t.ack(again)
                backlog = t.backlog()
                deadline = time.monotonic() + 15
                while backlog != {"ready": 0, "delayed": 0} and time.monotonic() < deadline:
                    for rest in t.receive(1, 0.5):  # "true 2", if it has not come yet
                        t.ack(rest)
                    backlog = t.backlog()
                assert backlog == {"ready": 0, "delayed": 0}
    finally:
        t.close()

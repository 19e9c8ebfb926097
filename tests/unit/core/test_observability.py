"""Issue 38, the cheap paths: the consumer's metric series stay fixed over 1,000 messages with
distinct ids, commands, tenants and made-up failure kinds (the real consumer, the fake client and
an in-memory queue), and without OpenTelemetry installed the lifecycle runs with no span at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pandastack_jobs.queue import Consumer, Delivery
from pandastack_jobs.queue.memory import MemoryTransport as _Memory
from pandastack_jobs.queue.metrics import ConsumerMetrics, sent_at
from pandastack_jobs.testing import FakeClient
from tests.unit.core.test_queue_chunks import _Fake

REPO = Path(__file__).resolve().parents[3]


def series(metrics: ConsumerMetrics) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items())))
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_1000_distinct_messages_leave_the_consumer_series_unchanged() -> None:
    fake = FakeClient()
    fake.script("fail", exit_code=3, stderr="no\n")
    fake.script(lambda cmd: "echo" in cmd, result={"ok": True})
    t = _Memory()
    consumer = Consumer(t, _Fake(fake), concurrency=8, max_deliveries=1, release_delay=0, poll_seconds=0.01)
    metrics = ConsumerMetrics(consumer)
    consumer.observer = metrics

    def put(i: int) -> None:
        t.put({"id": f"id-{i}", "command": f"echo {i}", "tenant": f"tenant-{i}"})
        t.put({"id": f"bad-{i}", "command": f"fail {i}", "tenant": f"t-{i}"})
        t.send(f"not json {i}".encode(), f"junk-{i}")

    put(0)
    consumer.run(lambda s: s.received >= 3 and s.in_flight == 0 and not t.waiting)
    first = series(metrics)
    metrics.dead_lettered(Delivery("x", b"", 1), "made-up-kind-0")  # an unknown kind: "other"
    first |= series(metrics)

    consumer2 = Consumer(t, _Fake(fake), concurrency=8, max_deliveries=1, release_delay=0, poll_seconds=0.01)
    consumer2.observer = metrics
    metrics.consumer = consumer2
    for i in range(1, 334):
        put(i)
    for i in range(1, 50):
        metrics.dead_lettered(Delivery(f"x{i}", b"", 1), f"made-up-kind-{i}")
    consumer2.run(lambda s: s.received >= 999 and s.in_flight == 0 and not t.waiting)
    assert consumer2.stats.received == 999 and consumer2.stats.acked == 333
    assert consumer2.stats.dead_lettered == 666
    assert series(metrics) == first


def test_a_producer_written_send_time_is_believed_only_when_sane() -> None:
    import time

    now = time.time()
    assert abs(sent_at(Delivery("m", b"", 1, extra={"sent": str(int(now * 1000))})) - now) < 1  # type: ignore[operator]
    assert abs(sent_at(Delivery("m", b"", 1, extra={"sent": now - 5})) - (now - 5)) < 1  # type: ignore[operator]
    for bad in ("nan", "inf", "-1", "1e300", b"\xff", "x", None, str(now + 10 * 365 * 86400)):
        assert sent_at(Delivery("m", b"", 1, extra={"sent": bad})) is None


def test_without_opentelemetry_a_job_runs_and_makes_no_span() -> None:
    code = """
import sys
sys.modules["opentelemetry"] = None  # as if the [otel] extra were not installed
from pandastack_jobs import JobSpec, run_job, tracing
from pandastack_jobs.testing import FakeClient
assert not tracing.enabled()
fake = FakeClient()
fake.script("echo", result={"ok": 1})
out = run_job(fake, JobSpec(command="echo hi", template="base", timeout=5))
assert out.ok, out
with tracing.send_span("redis", "q") as tp:
    assert tp is None
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
